"""A diffusers model folder: its index, its components' configs, and loading a component offline."""
from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any


def model_index(model_path: Path) -> dict:
    index_path = Path(model_path) / "model_index.json"
    if not index_path.is_file():
        raise FileNotFoundError(f"{index_path} not found: model.path must be a diffusers-format model folder"
                                " or a single-file .safetensors checkpoint")
    return json.loads(index_path.read_text())


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
    spec = model_index(model_path).get(name)
    if not isinstance(spec, list) or spec[0] is None:
        raise ValueError(f"{model_path}/model_index.json has no {name}: the model folder is incomplete")
    library, class_name = spec
    return getattr(importlib.import_module(library), class_name).from_pretrained(model_path, subfolder=name, **kwargs)


def vae_scale_factor(model_path: Path, vae: str) -> int:
    """Pixels per latent side: 2 ** (the VAE's levels - 1), as diffusers' pipelines compute it."""
    return 2 ** (len(component_config(model_path, vae)["block_out_channels"]) - 1)
