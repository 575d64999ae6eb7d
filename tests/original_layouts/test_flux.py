"""Flux.1 (dev, Kontext) transformers from files in BFL's layout, bare or under ComfyUI's prefix:
each converts to the tiny folder's weights exactly, through the family's size-free converter
(diffusers' own fixes Flux.1's inner width, so its from_single_file cannot read a tiny file)."""
from __future__ import annotations

import json

import pytest

from lorapipe.cache.errors import UserError
from lorapipe.stages import families
from lorapipe.stages.families.flux1 import tensor_map

from . import COMFYUI_PREFIX, assert_same_tensors, convert_written, folder_tensors
from .flux import to_original


def bfl_transformer(model) -> dict:
    config = json.loads((model / "transformer" / "config.json").read_text())
    shape = tensor_map(config["num_layers"], config["num_single_layers"], config["guidance_embeds"])
    return to_original(shape, folder_tensors(model, "transformer"))


@pytest.mark.parametrize("arch", ["flux1", "flux1-kontext"])
def test_a_bfl_transformer_converts_exactly_bare_or_under_comfyuis_prefix(tmp_path, tiny_models, arch):
    model, family = tiny_models(arch), families.get(arch)
    original = bfl_transformer(model)
    assert "double_blocks.0.img_attn.qkv.weight" in original and "single_blocks.0.linear1.bias" in original
    for prefix in ("", COMFYUI_PREFIX):
        assert_same_tensors(convert_written(family, "transformer", model, original, tmp_path, prefix),
                            folder_tensors(model, "transformer"))


def test_a_bfl_file_with_a_tensor_left_over_is_one_line(tmp_path, flux_model):
    original = {**bfl_transformer(flux_model), "lora_unet_x.alpha": next(iter(bfl_transformer(flux_model).values()))}
    with pytest.raises(UserError, match=r"^model.transformer: .* not a FluxTransformer2DModel .*lora_unet_x.alpha is"
                                        r" not a tensor of this model \(1 left over\)"):
        convert_written(families.get("flux1"), "transformer", flux_model, original, tmp_path)
