"""A base model's identity: the content digests of its components.

A model is a diffusers-format folder or one `.safetensors` checkpoint in the original layout, as
A1111/ComfyUI users have them (its family from stages/families, which also converts it). Folder
keys use per-component digests so that, say, a new VAE re-encodes latents but no text; a single
file's identity is its content digest for every component of its family. A component set over the
base (model.transformer, model.vae, ...) is keyed by its own content, the others by the base's.
"""
from __future__ import annotations

from pathlib import Path

from lorapipe.cache.digest import StatCache, digest_tree
from lorapipe.cache.errors import UserError
from lorapipe.stages.families import Family, is_single_file
from lorapipe.stages.families.folders import (SINGLE_FILE_SUFFIX, check_weights_file, component_class, component_names,
                                              index_file)


def component_digests(model_path: Path, stat_cache: StatCache, family: Family) -> dict[str, str]:
    """Digest of every component the model index names (vae, text encoders, denoiser, ...); for a
    single file, the file's digest for every component of `family`."""
    if is_single_file(model_path):
        check_weights_file(Path(model_path))
        digest = stat_cache.digest(Path(model_path))
        return {name: digest for name in sorted(family.components.all())}
    digests = {}
    for name in component_names(model_path):
        folder = Path(model_path) / name
        if not folder.is_dir():
            raise UserError(f"{index_file(model_path)} names {name!r} but there is no folder {folder}")
        digests[name] = weights_digest(folder, stat_cache)
    return digests


def weights_digest(path: Path, stat_cache: StatCache) -> str:
    """A component's content digest (one set over a base is keyed by it): of its one weights file,
    or of its folder's files, every weights file checked whole first."""
    if path.is_file():
        check_weights_file(path)
        return stat_cache.digest(path)
    for weights in sorted(path.rglob(f"*{SINGLE_FILE_SUFFIX}")):
        check_weights_file(weights)
    return digest_tree(path, stat_cache)


def import_model_code(model_path: Path, family: Family, stage: str) -> None:
    """Import the classes of the components `stage` loads: torch, diffusers, transformers and the
    model's own modules, most of a stage's first seconds on a small job, so that a caller can import
    them ahead (flows/commands.py: while Prefect's server starts). A single-file checkpoint is left
    alone (its diffusers folder is built by the stage)."""
    if is_single_file(model_path):
        return
    for name in family.components.for_stage(stage):
        component_class(model_path, name)
