"""Flux.1 (dev, schnell, Kontext) and Flux.2 (klein, dev) transformers from files in BFL's layout, bare or under
ComfyUI's prefix: each converts to the tiny folder's weights exactly; Flux.1's through the family's
size-free converter (diffusers' own fixes Flux.1's inner width, so its from_single_file cannot read
a tiny file), Flux.2's through diffusers' converter, whose from_single_file reads the same."""
from __future__ import annotations

import json

import pytest
import torch
from diffusers import AutoencoderKL, Flux2Transformer2DModel

from lorapipe.cache.errors import UserError
from lorapipe.stages import families
from lorapipe.stages.families.flux1 import tensor_map
from lorapipe.stages.sources.convert import convert_component

from . import COMFYUI_PREFIX, assert_diffusers_reads_the_same, assert_same_tensors, convert_written, folder_tensors, \
    to_original, write_file
from .flux import flux2_map
from .sd import ldm_component


def bfl_transformer(model) -> dict:
    config = json.loads((model / "transformer" / "config.json").read_text())
    shape = tensor_map(config["num_layers"], config["num_single_layers"], config["guidance_embeds"])
    return to_original(shape, folder_tensors(model, "transformer"))


@pytest.mark.parametrize("arch", ["flux1", "flux1-schnell", "flux1-kontext"])
def test_a_bfl_transformer_converts_exactly_bare_or_under_comfyuis_prefix(tmp_path, tiny_models, arch):
    model = tiny_models(arch)
    family = families.for_model(model)
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


@pytest.mark.parametrize("arch", ["flux2-klein", "flux2-dev"])  # Flux.2-dev's guidance_in too
def test_a_flux2_bfl_transformer_converts_exactly_and_diffusers_reads_the_same(tmp_path, tiny_models, arch):
    model = tiny_models(arch)
    config = json.loads((model / "transformer" / "config.json").read_text())
    original = to_original(flux2_map(config), folder_tensors(model, "transformer"))
    assert "double_blocks.0.img_attn.qkv.weight" in original and "single_blocks.0.linear1.weight" in original
    for prefix in ("", COMFYUI_PREFIX):
        assert_same_tensors(convert_written(families.get(arch), "transformer", model, original, tmp_path, prefix),
                            folder_tensors(model, "transformer"))
    file = write_file(original, tmp_path / "flux2.safetensors")
    assert_diffusers_reads_the_same(Flux2Transformer2DModel, file, model, "transformer")


def test_text_encoder_files_in_transformers_names_load_as_the_folders(tmp_path, flux_model):
    """ComfyUI's clip_l and t5xxl files: transformers' names, written with the base's config."""
    from lorapipe.stages.families.folders import load_component

    flux1 = families.get("flux1")
    for component in ("text_encoder", "text_encoder_2"):
        convert_written(flux1, component, flux_model, folder_tensors(flux_model, component), tmp_path)
        folder = load_component(flux_model, component)
        assert_same_tensors(type(folder).from_pretrained(tmp_path / component).state_dict(), folder.state_dict())


def test_at_flux1s_real_width_the_writer_and_the_row_map_agree_with_diffusers_converter():
    """Independent of the row map: at Flux.1's own widths (rows; one column each, so it is small)
    diffusers' converter reads what the writer wrote back to the diffusers tensors, as the family's
    size-free converter does."""
    from accelerate import init_empty_weights
    from diffusers import FluxTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    from lorapipe.stages.families.flux1 import bfl_transformer as size_free

    config = {"num_layers": 1, "num_single_layers": 1, "guidance_embeds": True}  # the rest: Flux.1's defaults
    with init_empty_weights():
        shapes = {k: v.shape for k, v in FluxTransformer2DModel(**config).state_dict().items()}
    thin = {k: torch.randn(shape[0], *([1] if len(shape) > 1 else [])) for k, shape in shapes.items()}
    original = to_original(tensor_map(1, 1, True), thin)
    assert_same_tensors(convert_flux_transformer_checkpoint_to_diffusers(dict(original)), thin)
    assert_same_tensors(size_free(original, config), thin)


@pytest.mark.parametrize("prefix", ["", "vae."])
def test_bfls_ae_file_converts_exactly_and_diffusers_reads_the_same(tmp_path, flux_model, prefix):
    """BFL's ae.safetensors: the VAE in LDM's names, bare (or under ComfyUI's `vae.` in a checkpoint)."""
    original = ldm_component(flux_model, "vae")
    assert "decoder.mid.attn_1.q.weight" in original
    converted = convert_written(families.get("flux1"), "vae", flux_model, original, tmp_path, prefix)
    assert_same_tensors(converted, folder_tensors(flux_model, "vae"))
    file = write_file(original, tmp_path / "ae.safetensors", prefix)
    assert_diffusers_reads_the_same(AutoencoderKL, file, flux_model, "vae")


def test_each_component_of_a_whole_comfyui_flux1_checkpoint_converts_exactly(tmp_path, flux_model):
    """ComfyUI's Flux.1 checkpoints: the BFL transformer, BFL's VAE and the two text encoders, each
    under its prefix in one file."""
    from lorapipe.stages.families.folders import load_component

    flux1 = families.get("flux1")
    parts = {"transformer": (COMFYUI_PREFIX, bfl_transformer(flux_model)),
             "vae": ("vae.", ldm_component(flux_model, "vae")),
             **{c: (flux1.checkpoint_prefixes[c], folder_tensors(flux_model, c))
                for c in ("text_encoder", "text_encoder_2")}}
    whole = write_file({prefix + k: v for prefix, tensors in parts.values() for k, v in tensors.items()},
                       tmp_path / "flux1-dev-fp16.safetensors")
    for component in parts:
        convert_component(flux1, component, whole, flux_model, tmp_path / component, print)
    for component in ("transformer", "vae"):
        assert_same_tensors(folder_tensors(tmp_path / component), folder_tensors(flux_model, component))
    for component in ("text_encoder", "text_encoder_2"):
        folder = load_component(flux_model, component)
        assert_same_tensors(type(folder).from_pretrained(tmp_path / component).state_dict(), folder.state_dict())
