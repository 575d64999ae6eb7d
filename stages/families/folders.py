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
    """Pixels per latent side, as diffusers' pipelines compute it: 2 ** (the VAE's levels - 1), or
    for a video VAE (Qwen-Image's) 2 ** its number of downsampling stages."""
    config = component_config(model_path, vae)
    if "temperal_downsample" in config:
        return 2 ** len(config["temperal_downsample"])
    return 2 ** (len(config["block_out_channels"]) - 1)


def component_tensors(model_path: Path, name: str, keys: tuple[str, ...]) -> dict:
    """Named tensors of a component's safetensors weights, read without loading the component."""
    from safetensors import safe_open

    found = {}
    for file in sorted((Path(model_path) / name).glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            found.update({key: f.get_tensor(key) for key in keys if key in f.keys()})
    missing = [key for key in keys if key not in found]
    if missing:
        raise ValueError(f"{Path(model_path) / name} has no tensor {missing[0]}: the model folder is incomplete")
    return found
