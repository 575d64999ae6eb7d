"""Single-file checkpoints (A1111/ComfyUI layout) converted once, offline, into diffusers folders.

The architecture configs a conversion needs ship in stages/assets/arch/<family>/ (no network):
a pipeline's `from_single_file(checkpoint, config=<that folder>)` reads the weights, and the
result is saved as a diffusers folder under the cache's models/<digest>/ that every stage then
loads like any other.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

ARCH_ROOT = Path(__file__).resolve().parent.parent / "assets" / "arch"


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
    try:
        staging.rename(target)
    except OSError:  # another process converted it first
        shutil.rmtree(staging)
    return target
