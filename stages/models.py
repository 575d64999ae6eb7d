"""Base models: family detection and identity (a digest of each component's files).

Keys use per-component digests so that, say, a new VAE re-encodes latents but no text.
"""
from __future__ import annotations

import json
from pathlib import Path

from cache.digest import StatCache, digest_tree

FAMILIES = {"StableDiffusionPipeline": "sd15", "StableDiffusionXLPipeline": "sdxl"}


def model_index(model_path: Path) -> dict:
    index_path = Path(model_path) / "model_index.json"
    if not index_path.is_file():
        raise FileNotFoundError(f"{index_path} not found: model.path must be a diffusers-format model folder")
    return json.loads(index_path.read_text())


def model_family(model_path: Path) -> str:
    name = model_index(model_path).get("_class_name")
    if name not in FAMILIES:
        raise ValueError(f"{model_path}/model_index.json: unsupported pipeline class {name!r}")
    return FAMILIES[name]


def component_digests(model_path: Path, stat_cache: StatCache) -> dict[str, str]:
    """Digest of every component folder the model index names (vae, unet, text_encoder, ...)."""
    index = model_index(model_path)
    return {
        name: digest_tree(Path(model_path) / name, stat_cache)
        for name, spec in sorted(index.items())
        if not name.startswith("_") and isinstance(spec, list) and spec[0] is not None
    }
