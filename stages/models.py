"""Base models: family detection, identity (content digests) and single-file checkpoints.

A model is a diffusers-format folder or one `.safetensors` checkpoint in the original (LDM) layout,
as A1111/ComfyUI users have them. Folder keys use per-component digests so that, say, a new VAE
re-encodes latents but no text; a single file's identity is its content digest for every component.
A single file is converted once, with the architecture configs shipped in stages/assets/arch/<family>/
(no network), into a diffusers folder that every stage then loads like any other (`diffusers_folder`).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from cache.digest import StatCache, digest_tree
from cache.errors import UserError

FAMILIES = {"StableDiffusionPipeline": "sd15", "StableDiffusionXLPipeline": "sdxl"}
PIPELINES = {family: name for name, family in FAMILIES.items()}
ARCH_ROOT = Path(__file__).resolve().parent / "assets" / "arch"
SINGLE_FILE_SUFFIX = ".safetensors"
SDXL_UNET_KEY = "model.diffusion_model.label_emb.0.0.weight"  # SDXL's size/crop embedding; SD1.x/2.x have none
LDM_UNET_KEY = "model.diffusion_model.input_blocks.0.0.weight"


def is_single_file(model_path: Path) -> bool:
    return Path(model_path).suffix == SINGLE_FILE_SUFFIX


def model_index(model_path: Path) -> dict:
    index_path = Path(model_path) / "model_index.json"
    if not index_path.is_file():
        raise UserError(f"{index_path} not found: model.path must be a diffusers-format model folder"
                        f" or a single-file {SINGLE_FILE_SUFFIX} checkpoint")
    try:
        return json.loads(index_path.read_text())
    except ValueError as e:
        raise UserError(f"{index_path}: not valid JSON ({e})") from None


def check_weights_file(path: Path) -> None:
    """Raise UserError unless `path` is a whole safetensors file: its header parses and its last
    tensor ends where the file ends (a truncated download or copy does not). Reads the header only."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        length = int.from_bytes(prefix, "little") if len(prefix) == 8 else 0
        try:
            header = json.loads(f.read(length)) if 0 < length <= size - 8 else None
        except ValueError:
            header = None
    if not isinstance(header, dict):
        raise UserError(f"{path} is not a readable safetensors file ({size:,} bytes): copy or download it again")
    end = 8 + length + max((t["data_offsets"][1] for name, t in header.items() if name != "__metadata__"), default=0)
    if end != size:
        raise UserError(f"{path} is truncated or damaged: its header describes {end:,} bytes but the file has"
                        f" {size:,}: copy or download it again")


def single_file_family(path: Path) -> str:
    """sd15 or sdxl, from the checkpoint's tensor names (read from its header only)."""
    from safetensors import safe_open

    if not Path(path).is_file():
        raise UserError(f"model.path: {path} is not a file")
    check_weights_file(Path(path))
    with safe_open(path, "pt") as f:
        keys = set(f.keys())
    if SDXL_UNET_KEY in keys:
        return "sdxl"
    if LDM_UNET_KEY in keys:
        return "sd15"
    raise ValueError(f"model.path: {path} has no {LDM_UNET_KEY}: not a Stable Diffusion checkpoint in the"
                     " original layout (give a diffusers folder)")


def model_family(model_path: Path, family: str | None = None) -> str:
    """The family a single file is declared as (`model.family`) or detected as; a folder's from its index."""
    if is_single_file(model_path):
        return family or single_file_family(Path(model_path))
    name = model_index(model_path).get("_class_name")
    if name not in FAMILIES:
        raise UserError(f"{model_path}/model_index.json: unsupported pipeline class {name!r}"
                        f" (supported: {', '.join(FAMILIES)})")
    if family and family != FAMILIES[name]:
        raise ValueError(f"model.family is {family} but {model_path}/model_index.json is a {FAMILIES[name]} model")
    return FAMILIES[name]


def component_digests(model_path: Path, stat_cache: StatCache, family: str | None = None) -> dict[str, str]:
    """Digest of every component the model index names (vae, unet, text_encoder, ...); for a single
    file, the file's digest for every component of its family's architecture."""
    if is_single_file(model_path):
        family = model_family(model_path, family)
        check_weights_file(Path(model_path))
        digest = stat_cache.digest(Path(model_path))
        return {name: digest for name in _components(ARCH_ROOT / family)}
    digests = {}
    for name in _components(model_path):
        folder = Path(model_path) / name
        if not folder.is_dir():
            raise UserError(f"{model_path}/model_index.json names {name!r} but there is no folder {folder}")
        for weights in sorted(folder.rglob(f"*{SINGLE_FILE_SUFFIX}")):
            check_weights_file(weights)
        digests[name] = digest_tree(folder, stat_cache)
    return digests


def _components(model_path: Path) -> list[str]:
    return [name for name, spec in sorted(model_index(model_path).items())
            if not name.startswith("_") and isinstance(spec, list) and spec[0] is not None]


def diffusers_folder(checkpoint: Path, digest: str, family: str, models_root: Path,
                     arch_dir: Path | None = None) -> Path:
    """`models_root/<digest>/`: the single-file checkpoint loaded with `from_single_file` and the
    architecture configs in `arch_dir` (default: the shipped ones), saved in diffusers format once."""
    import diffusers

    target = Path(models_root) / digest
    if (target / "model_index.json").is_file():
        return target
    arch_dir = Path(arch_dir or ARCH_ROOT / family)
    for tokenizer in sorted(arch_dir.glob("tokenizer*")):
        if not any((tokenizer / name).is_file() for name in ("vocab.json", "tokenizer.json")):
            raise FileNotFoundError(f"{tokenizer}: no vocab.json/merges.txt (the CLIP BPE vocabulary is not shipped):"
                                    f" copy them from the {family} model's {tokenizer.name} folder")
    extra = {"safety_checker": None, "requires_safety_checker": False} if family == "sd15" else {}
    pipe = getattr(diffusers, PIPELINES[family]).from_single_file(str(checkpoint), config=str(arch_dir), **extra)
    staging = target.with_name(f".{digest}.{os.getpid()}.tmp")
    pipe.save_pretrained(staging, safe_serialization=True)
    try:
        staging.rename(target)
    except OSError:  # another process converted it first
        shutil.rmtree(staging)
    return target
