"""Single-file checkpoints (A1111/ComfyUI layout) converted once, offline, into diffusers folders.

The architecture configs a conversion needs ship in stages/assets/arch/<family>/ (no network):
a pipeline's `from_single_file(checkpoint, config=<that folder>)` reads the weights, and the
result is saved as a diffusers folder under the cache's models/<digest>/ that every stage then
loads like any other.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lorapipe.cache.errors import UserError
from lorapipe.cache.fsutil import publish_folder

if TYPE_CHECKING:
    from .base import Family

ARCH_ROOT = Path(__file__).resolve().parent.parent / "assets" / "arch"


def single_file_folder(family: Family, checkpoint: Path, digest: str, models_root: Path,
                       arch_dir: Path | None = None) -> Path:
    """A single-file checkpoint of `family` converted once into a diffusers folder under models_root
    that every stage then loads like any other (`arch_dir`: the architecture configs to convert
    with; default: the ones shipped for the family, whose tokenizer folders lack CLIP's BPE
    vocabulary: the user copies it in, the error says so)."""
    if family.single_file_kwargs is None:  # the file holds the denoiser alone
        denoiser = family.components.denoiser
        raise UserError(f"model.path: {checkpoint} is a {family.label} {denoiser} alone, not a whole model: set"
                        f" model.path to a {family.label} base (a diffusers folder or a Hugging Face repo id) and"
                        f" model.{denoiser}: {checkpoint}")
    arch_dir = Path(arch_dir or ARCH_ROOT / family.name)
    for tokenizer in sorted(arch_dir.glob("tokenizer*")):
        if not any((tokenizer / name).is_file() for name in ("vocab.json", "tokenizer.json")):
            raise FileNotFoundError(f"{tokenizer}: no vocab.json/merges.txt (the CLIP BPE vocabulary is not"
                                    f" shipped): copy them from the {family.name} model's {tokenizer.name} folder")
    return converted_folder(checkpoint, digest, family.pipeline_class, arch_dir, models_root,
                            **family.single_file_kwargs)


def converted_folder(checkpoint: Path, digest: str, pipeline_class: str, arch_dir: Path, models_root: Path,
                     **pipeline_kwargs: Any) -> Path:
    """`models_root/<digest>/`: `checkpoint` loaded by `pipeline_class.from_single_file` with the
    configs in `arch_dir`, saved in diffusers format (once: a folder already there is reused)."""
    import diffusers

    target = Path(models_root) / digest
    if (target / "model_index.json").is_file():
        return target
    pipe = getattr(diffusers, pipeline_class).from_single_file(str(checkpoint), config=str(arch_dir), **pipeline_kwargs)
    staging = target.with_name(f".{digest}.{os.getpid()}.tmp")
    pipe.save_pretrained(staging, safe_serialization=True)
    publish_folder(staging, target)
    return target
