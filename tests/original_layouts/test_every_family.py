"""Every family from a Hugging Face repo id (an offline cache as huggingface_hub writes it) with its
denoiser given as one file in the family's original layout under ComfyUI's prefix, the way a
ComfyUI user has it: the run's Context composes a model that is the same family and variant as
the folder, whose denoiser loads to exactly the folder's weights, keyed by the file's own digest
while every other component keeps the folder's. A family whose denoiser has no writer here fails:
a new family adds its layout (tests/original_layouts/). Training from such a model is checked
byte for byte in test_training.py (Flux.1's size-free path, SD1.5); for the others the weights
training loads are the folder's, bit for bit. A denoiser file given alone as model.path is told
apart by its tensor names, and refused in one line naming the keys to set."""
from __future__ import annotations

import json
import re
from pathlib import Path

import huggingface_hub
import pytest
import torch
from hub_cache import write_hub_cache

from lorapipe.cache.digest import StatCache
from lorapipe.cache.errors import UserError
from lorapipe.flows.config import validate_config
from lorapipe.flows.steps import Context
from lorapipe.stages import families
from lorapipe.stages.families.chroma import tensor_map as chroma_map
from lorapipe.stages.models import component_digests

from . import COMFYUI_PREFIX, assert_same_tensors, folder_tensors, to_original, write_file
from .flux import flux2_map
from .sd import unet_to_ldm
from .test_families_2026 import WRITERS, original
from .test_flux import bfl_transformer

ORIGINAL_LAYOUT = {  # the denoiser's class -> (its folder, its component) -> its tensors in the original names
    **dict.fromkeys(WRITERS, original),
    "UNet2DConditionModel": lambda model, c: unet_to_ldm(folder_tensors(model, c), config_of(model, c)),
    "FluxTransformer2DModel": lambda model, c: bfl_transformer(model),
    "Flux2Transformer2DModel": lambda model, c: to_original(flux2_map(config_of(model, c)), folder_tensors(model, c)),
    # no converter, or ERNIE's or HiDream's that keeps them: diffusers' names (Kandinsky 5's: its own, ComfyUI's)
    **dict.fromkeys(("HunyuanVideo15Transformer3DModel", "HunyuanImageTransformer2DModel",
                      "ErnieImageTransformer2DModel", "HiDreamImageTransformer2DModel",
                      "Kandinsky5Transformer3DModel"), folder_tensors),
    "ChromaTransformer2DModel": lambda model, c: to_original(chroma_map(*(config_of(model, c)[k] for k in (
        "num_layers", "num_single_layers", "approximator_layers"))), folder_tensors(model, c)),
}
ARCHES = [family.variants[0].tiny_arch for family in families.FAMILIES.values()] + ["wan2.2-a14b"]


def config_of(model: Path, component: str) -> dict:
    return json.loads((model / component / "config.json").read_text())


def original_file(model: Path, component: str, out: Path) -> Path:
    tensors = ORIGINAL_LAYOUT[config_of(model, component)["_class_name"]](model, component)
    return write_file(tensors, out / f"{component}.safetensors", COMFYUI_PREFIX)


@pytest.mark.parametrize("arch", ARCHES)
def test_a_repo_id_with_its_denoiser_as_an_original_layout_file_is_the_folders_model(tmp_path, tiny_models,
                                                                                     monkeypatch, arch):
    model = tiny_models(arch)
    hf_cache = tmp_path / "hf-cache"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hf_cache))
    write_hub_cache(hf_cache, f"tiny/{arch}", model)
    folder_family = families.for_model(model)
    denoisers = folder_family.components.denoisers()
    files = {name: original_file(model, name, tmp_path) for name in denoisers}
    raw = {"cache_dir": str(tmp_path / "cache"), "output_dir": str(tmp_path / "out"),
           "model": {"path": f"tiny/{arch}", **{name: str(file) for name, file in files.items()}},
           "data": {"path": str(tmp_path)}, "train": {}, "evaluate": {"prompts": ["a photo"]}}
    ctx = Context(validate_config(raw, "test"))

    composed = ctx.model_path
    assert (ctx.family.name, ctx.family.variant) == (folder_family.name, folder_family.variant)
    for name in denoisers:
        assert_same_tensors(folder_tensors(composed, name), folder_tensors(model, name))
    loaded = ctx.family.load_denoiser(composed, torch.float32).state_dict()
    assert_same_tensors(loaded, folder_family.load_denoiser(model, torch.float32).state_dict())
    folder_digests = component_digests(model, StatCache(tmp_path / "stat.sqlite"), folder_family)
    changed = {name for name, digest in ctx.model_digests.items() if digest != folder_digests[name]}
    assert changed == set(denoisers)  # keyed by the files: only train and evaluate see another model
    assert all(ctx.model_digests[name] == ctx.stat_cache.digest(file) for name, file in files.items())



@pytest.mark.parametrize("arch", ["flux1", "flux2-klein", "flux3", "z-image", "qwen-image", "qwen-image-2.1", "krea2",
                                  "wan2.1", "ltx2", "ernie-image", "chroma", "hidream-i1"])
def test_a_denoiser_file_alone_is_told_by_its_names_and_the_error_names_the_keys_to_set(tmp_path, tiny_models, arch):
    model = tiny_models(arch)
    family = families.for_model(model)
    tensors = ORIGINAL_LAYOUT[config_of(model, "transformer")["_class_name"]](model, "transformer")
    for prefix in ("", COMFYUI_PREFIX):
        file = write_file(tensors, tmp_path / f"alone{prefix.replace('.', '_')}.safetensors", prefix)
        assert families.for_model(file).name == family.name
        raw = {"cache_dir": str(tmp_path / "cache"), "output_dir": str(tmp_path / "out"), "model": {"path": str(file)},
               "data": {"path": str(tmp_path)}, "train": {}, "evaluate": {"prompts": ["a photo"]}}
        with pytest.raises(UserError, match=rf"^model.path: {file} is a {re.escape(family.label)} transformer alone,"
                                            rf" .* and model.transformer: {file}$"):
            Context(validate_config(raw, "test")).model_path
