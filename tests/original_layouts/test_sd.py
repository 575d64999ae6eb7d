"""SD1.x and SDXL components from files in A1111's (LDM) layout, bare or under their prefixes,
from a whole A1111 checkpoint, and from files already in diffusers' names: each converts to the
tiny folder's weights exactly; diffusers' own single-file loader reads the same."""
from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKL, UNet2DConditionModel
from safetensors.torch import save_file
from transformers import CLIPTextModel

from lorapipe.cache.errors import UserError
from lorapipe.stages import families
from lorapipe.stages.sources.convert import convert_component, write_sharded

from . import COMFYUI_PREFIX, assert_diffusers_reads_the_same, assert_same_tensors, convert_written, folder_tensors, \
    write_file
from .sd import ldm_component, write_ldm_checkpoint


@pytest.mark.parametrize("arch", ["sd15", "sdxl"])
def test_an_ldm_unet_and_vae_convert_exactly_bare_or_under_their_prefixes(tmp_path, tiny_models, arch):
    model, family = tiny_models(arch), families.get(arch)
    for component, cls in (("unet", UNet2DConditionModel), ("vae", AutoencoderKL)):
        original = ldm_component(model, component)
        for prefix in ("", family.checkpoint_prefixes[component]):
            assert_same_tensors(convert_written(family, component, model, original, tmp_path, prefix),
                                folder_tensors(model, component))
        file = write_file(original, tmp_path / f"{component}.safetensors", family.checkpoint_prefixes[component])
        assert_diffusers_reads_the_same(cls, file, model, component)


def test_each_component_of_a_whole_a1111_checkpoint_converts_exactly(tmp_path, tiny_model):
    sd15 = families.get("sd15")
    checkpoint = write_ldm_checkpoint(tiny_model, tmp_path / "whole.safetensors", sd15)
    for component in ("unet", "vae"):
        convert_component(sd15, component, checkpoint, tiny_model, tmp_path / component, print)
        assert_same_tensors(folder_tensors(tmp_path / component), folder_tensors(tiny_model, component))
    convert_component(sd15, "text_encoder", checkpoint, tiny_model, tmp_path / "text_encoder", print)
    loaded = CLIPTextModel.from_pretrained(tmp_path / "text_encoder").state_dict()  # the file's names kept
    assert_same_tensors(loaded, CLIPTextModel.from_pretrained(tiny_model / "text_encoder").state_dict())


def test_a_file_in_diffusers_names_is_kept_under_comfyuis_prefix_or_none(tmp_path, tiny_model):
    sd15, unet = families.get("sd15"), folder_tensors(tiny_model, "unet")
    for prefix in ("", COMFYUI_PREFIX, "diffusion_model."):
        assert_same_tensors(convert_written(sd15, "unet", tiny_model, unet, tmp_path, prefix), unet)


def test_a_file_that_does_not_fit_the_base_is_one_line_naming_file_key_and_shapes(tmp_path, tiny_model, sdxl_model):
    sd15 = families.get("sd15")
    with pytest.raises(UserError, match=r"^model.unet: .*unet\.safetensors: .* has shape \(.*\), the base model's"):
        convert_written(sd15, "unet", tiny_model, ldm_component(sdxl_model, "unet"), tmp_path)
    unet = folder_tensors(tiny_model, "unet")
    dropped = sorted(unet)[0]
    with pytest.raises(UserError, match=rf"^model.unet: .* has no {dropped} \(1 tensors missing\)"):
        convert_written(sd15, "unet", tiny_model, {k: v for k, v in unet.items() if k != dropped}, tmp_path)
    text = {k: v for k, v in ldm_component(tiny_model, "text_encoder").items() if "layers.0.mlp.fc1.weight" not in k}
    with pytest.raises(UserError, match=r"^model.text_encoders: .*: missing keys loading it as CLIPTextModel: "
                                        r"encoder.layers.0.mlp.fc1.weight \(1 in all\)$"):
        convert_written(sd15, "text_encoder", tiny_model, text, tmp_path)
    save_file({"x": torch.zeros(1)}, tmp_path / "cut.safetensors")
    (tmp_path / "cut.safetensors").write_bytes((tmp_path / "cut.safetensors").read_bytes()[:-2])
    with pytest.raises(UserError, match=r"^model.unet: .*cut.safetensors is truncated"):
        convert_component(sd15, "unet", tmp_path / "cut.safetensors", tiny_model, tmp_path / "t", print)


def test_a_large_component_is_written_in_shards_with_the_index_diffusers_and_transformers_read(tmp_path, tiny_model):
    for component, cls, stem in (("unet", UNet2DConditionModel, "diffusion_pytorch_model"),
                                 ("text_encoder", CLIPTextModel, "model")):
        folder = cls.from_pretrained(tiny_model / component)
        (tmp_path / component).mkdir()
        write_sharded(folder_tensors(tiny_model, component), tmp_path / component, stem, max_shard_size="100KB")
        assert len(list((tmp_path / component).glob(f"{stem}-*-of-*.safetensors"))) > 1
        assert (tmp_path / component / f"{stem}.safetensors.index.json").is_file()
        (tmp_path / component / "config.json").write_bytes((tiny_model / component / "config.json").read_bytes())
        assert_same_tensors(cls.from_pretrained(tmp_path / component).state_dict(), folder.state_dict())
