"""A diffusers model folder: its index, its components' configs, loading a component offline; and
whether a single weights file is whole."""
from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from lorapipe.cache.errors import UserError

SINGLE_FILE_SUFFIX = ".safetensors"
FLOAT_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2"}  # safetensors' names, as numpy's (and BF16)


# a DiffusionPipeline's index; a ModularPipeline's, for models diffusers ships only as modular pipelines
INDEX_FILES = ("model_index.json", "modular_model_index.json")


def found_index(model_path: Path) -> Path | None:
    """The folder's index: model_index.json, else modular_model_index.json; None for a folder with neither."""
    folder = Path(model_path)
    return next((folder / name for name in INDEX_FILES if (folder / name).is_file()), None)


def index_file(model_path: Path) -> Path:
    """found_index, or the error that the folder is not a model folder."""
    folder = Path(model_path)
    found = found_index(folder)
    if found is None:
        raise UserError(f"{folder / INDEX_FILES[0]} not found: model.path must be a diffusers-format model folder"
                        f" or a single-file {SINGLE_FILE_SUFFIX} checkpoint")
    return found


def model_index(model_path: Path) -> dict:
    """The folder's index as model_index.json has it: a modular index's component entries
    ([library, class, where]) become [library, class] once each is checked to be in the folder."""
    index_path = index_file(model_path)
    try:
        index = json.loads(index_path.read_text())
    except ValueError as e:
        raise UserError(f"{index_path}: not valid JSON ({e})") from None
    if index_path.name == INDEX_FILES[0]:
        return index
    return {key: _local_component(index_path, key, spec) if _is_modular_component(spec) else spec
            for key, spec in index.items()}


def _is_modular_component(spec: Any) -> bool:
    return isinstance(spec, list) and len(spec) == 3 and is_component(spec[:2]) and isinstance(spec[2], dict)


def _local_component(index_path: Path, key: str, spec: list) -> list[str]:
    """[library, class] of a modular index's entry that loads from the folder's own `key` subfolder
    (the folder, or for a Hugging Face cache's snapshot the repo it is a snapshot of); an entry
    pointing elsewhere (another repo or folder) is refused: nothing is read from outside the folder
    the user named."""
    source, subfolder = spec[2].get("pretrained_model_name_or_path"), spec[2].get("subfolder")
    folder = index_path.parent
    own = source is not None and (source == _snapshot_repo(folder) or Path(source).resolve() == folder.resolve())
    if not own or subfolder != key:
        raise UserError(f"{index_path}: {key} loads from {source!r} subfolder {subfolder!r}, not from this folder's"
                        f" {key}/; only a model saved whole into one folder (ModularPipeline.save_pretrained) is read")
    return spec[:2]


def _snapshot_repo(folder: Path) -> str | None:
    """The repo id of a Hugging Face cache's snapshot folder (models--owner--name/snapshots/<commit>);
    None for any other folder."""
    repo = folder.parent.parent.name
    if folder.parent.name != "snapshots" or not repo.startswith("models--"):
        return None
    return repo.removeprefix("models--").replace("--", "/")


def copy_index(base: Path, folder: Path, final: Path) -> None:
    """The index of `base` into `folder` for a model folder made of its components that will be at
    `final`: a modular index's component entries then load from `final`."""
    source = index_file(base)
    if source.name == INDEX_FILES[0]:
        shutil.copyfile(source, Path(folder) / source.name)
        return
    index = {key: [*spec[:2], {**spec[2], "pretrained_model_name_or_path": str(final)}]
             if _is_modular_component(spec) else spec for key, spec in json.loads(source.read_text()).items()}
    (Path(folder) / source.name).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def is_single_file(model_path: Path) -> bool:
    return Path(model_path).suffix == SINGLE_FILE_SUFFIX


def check_weights_file(path: Path) -> set[str]:
    """Raise UserError unless `path` is a whole safetensors file: its header parses and its last
    tensor ends where the file ends (a truncated download or copy does not). Reads the header only;
    returns its tensors' names."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        header, length = _safetensors_header(f, size)
    if header is None:
        raise UserError(f"{path} is not a readable safetensors file ({size:,} bytes): copy or download it again")
    end = 8 + length + max((t["data_offsets"][1] for name, t in header.items() if name != "__metadata__"), default=0)
    if end != size:
        raise UserError(f"{path} is truncated or damaged: its header describes {end:,} bytes but the file has"
                        f" {size:,}: copy or download it again")
    return set(header) - {"__metadata__"}


def tensor_headers(path: Path) -> dict[str, dict]:
    """The tensors of a whole safetensors file (check_weights_file): name -> dtype, shape and
    offsets, read from its header without loading it."""
    with open(path, "rb") as f:
        header, _ = _safetensors_header(f, path.stat().st_size)
    return {name: entry for name, entry in (header or {}).items() if name != "__metadata__"}


def component_config(model_path: Path, name: str) -> dict:
    """A component's config.json (scheduler_config.json for schedulers), without loading it."""
    folder = Path(model_path) / name
    for file in ("config.json", "scheduler_config.json"):
        if (folder / file).is_file():
            return json.loads((folder / file).read_text())
    raise FileNotFoundError(f"{folder} has no config.json: the model folder is incomplete")


def load_component(model_path: Path, name: str, **kwargs: Any) -> Any:
    """A component loaded with the class its model_index.json names (tokenizer, text encoder, VAE,
    denoiser or scheduler), from the local folder only."""
    return component_class(model_path, name).from_pretrained(model_path, subfolder=name, **kwargs)


def empty_component(model_path: Path, name: str) -> Any:
    """A model component built from its config.json with its weights on the meta device (not read)."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        return component_class(model_path, name).from_config(component_config(model_path, name))


def is_component(spec: Any) -> bool:
    """Whether a model_index.json entry names a component ([library, class]), not a pipeline setting
    that is a list too (Krea 2's text_encoder_select_layers) nor a component left out ([null, null])."""
    return isinstance(spec, list) and len(spec) == 2 and all(isinstance(part, str) for part in spec)


def component_names(model_path: Path) -> list[str]:
    """The components model_index.json names (not the pipeline's settings nor those left out), sorted."""
    return [name for name, spec in sorted(model_index(model_path).items())
            if not name.startswith("_") and is_component(spec)]


def component_class(model_path: Path, name: str) -> type:
    """The class model_index.json names for a component, its library's modules imported. A library
    that is a diffusers pipeline's own module (LTX-2's connectors' "ltx2") is looked up there first,
    as diffusers' loader does: a folder of that name in the working directory is not it."""
    spec = model_index(model_path).get(name)
    if not is_component(spec):
        raise ValueError(f"{index_file(model_path)} has no {name}: the model folder is incomplete")
    library, class_name = spec
    import diffusers.pipelines

    if hasattr(diffusers.pipelines, library):
        return getattr(getattr(diffusers.pipelines, library), class_name)
    return getattr(importlib.import_module(library), class_name)


def vae_scale_factor(model_path: Path, vae: str) -> int:
    """Pixels per latent side, as diffusers' pipelines compute it: the VAE's spatial_compression_ratio
    where its config has one (the Hunyuan VAEs'), else 2 ** (its levels - 1), or for a video VAE
    (Qwen-Image's) 2 ** its number of downsampling stages."""
    config = component_config(model_path, vae)
    if "spatial_compression_ratio" in config:
        return config["spatial_compression_ratio"]
    if "temperal_downsample" in config:
        return 2 ** len(config["temperal_downsample"])
    return 2 ** (len(config["block_out_channels"]) - 1)


def _safetensors_header(f: BinaryIO, size: int) -> tuple[dict | None, int]:
    """(the header of the safetensors file open in `f`, or None where it does not parse; its length)."""
    prefix = f.read(8)
    length = int.from_bytes(prefix, "little") if len(prefix) == 8 else 0
    try:
        header = json.loads(f.read(length)) if 0 < length <= size - 8 else None
    except ValueError:
        header = None
    return (header if isinstance(header, dict) else None), length


def _float64(raw: bytes, dtype: str) -> np.ndarray:
    """A tensor's little-endian bytes as float64 (every float type widens exactly)."""
    if dtype == "BF16":  # bfloat16 is the top half of a float32
        return (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view("<f4").astype(np.float64)
    return np.frombuffer(raw, FLOAT_DTYPES[dtype]).astype(np.float64)


def component_tensors(model_path: Path, name: str, keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Named float tensors of a component's safetensors weights, as float64 arrays. Read from the
    files' headers and bytes, without loading the component or importing torch: the keys of a
    run's stages read them, and a run served wholly from the cache imports no model code."""
    found = {}
    for file in sorted((Path(model_path) / name).glob("*.safetensors")):
        with open(file, "rb") as f:
            header, length = _safetensors_header(f, file.stat().st_size)
            for key in (k for k in keys if header and k in header):
                begin, end = header[key]["data_offsets"]
                f.seek(8 + length + begin)
                found[key] = _float64(f.read(end - begin), header[key]["dtype"]).reshape(header[key]["shape"])
    missing = [key for key in keys if key not in found]
    if missing:
        raise ValueError(f"{Path(model_path) / name} has no tensor {missing[0]}: the model folder is incomplete")
    return found
