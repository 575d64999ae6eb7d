"""Z-Image, Qwen-Image (its Edit models share its transformer), Qwen-Image 2.1, Krea 2, Ideogram 4,
Wan (T2V, I2V, both A14B experts, 2.1's VAE) and LTX-2 (transformer, video VAE) from files in their
original layouts (this package's zimage, qwenimage, krea2, ideogram4, wan and ltx2 writers), bare
and under ComfyUI's prefix or LTX-2's `vae.`: each converts to the tiny folder's weights exactly,
and diffusers' own from_single_file reads the same file to the same weights wherever it reads that
file (not Ideogram 4's: diffusers has no single-file loader for it; Qwen-Image's bare only)."""
from __future__ import annotations

import json

import diffusers
import pytest
import torch
from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

from lorapipe.cache.errors import UserError
from lorapipe.stages import families
from lorapipe.stages.families.wan_vae_names import wan21_vae
from lorapipe.stages.sources.convert import convert_component

from . import COMFYUI_PREFIX, assert_diffusers_reads_the_same, assert_same_tensors, convert_written, folder_tensors, \
    write_file
from . import flux3, ideogram4, krea2, ltx2, qwenimage, wan, zimage

WRITERS = {**flux3.WRITERS, **zimage.WRITERS, **qwenimage.WRITERS, **krea2.WRITERS, **ideogram4.WRITERS, **wan.WRITERS, **ltx2.WRITERS}
BOTH = ("", COMFYUI_PREFIX)
CASES = {  # (arch, component) -> (a key only the original layout has, prefixes, those diffusers reads)
    ("z-image", "transformer"): ("layers.0.attention.qkv.weight", BOTH, BOTH),
    ("qwen-image", "transformer"): ("transformer_blocks.0.img_mlp.net.0.proj.weight", BOTH, ("",)),
    ("qwen-image-2.1", "transformer"): ("transformer_blocks.0.img_mlp.gate_up.weight", BOTH, BOTH),
    ("krea2", "transformer"): ("blocks.0.attn.wq.weight", BOTH, BOTH),
    ("flux3", "transformer"): ("content_mode_blocks.image.0.q_proj.weight", BOTH, ("",)),
    ("ideogram4", "transformer"): ("layers.0.attention.to_q.weight", BOTH, ()),
    ("wan2.1", "transformer"): ("blocks.0.norm3.weight", BOTH, BOTH),
    ("wan2.1-i2v", "transformer"): ("blocks.0.cross_attn.k_img.weight", BOTH, BOTH),
    ("wan2.2-5b", "transformer"): ("head.modulation", BOTH, BOTH),
    ("wan2.2-a14b", "transformer_2"): ("blocks.1.self_attn.o.weight", BOTH, BOTH),
    ("wan2.2-i2v-a14b", "transformer_2"): ("blocks.1.ffn.0.weight", BOTH, BOTH),
    ("wan2.1", "vae"): ("decoder.upsamples.2.resample.1.weight", ("",), ()),  # diffusers' assumes 2 blocks a level
    ("ltx2", "transformer"): ("adaln_single.emb.timestep_embedder.linear_1.weight", BOTH, BOTH),
    ("ltx2", "vae"): ("encoder.down_blocks.8.res_blocks.0.conv1.conv.weight", ("", "vae."), ("", "vae.")),
}


def original(model, component: str) -> dict[str, torch.Tensor]:
    config = json.loads((model / component / "config.json").read_text())
    return WRITERS[config["_class_name"]](folder_tensors(model, component), config)


@pytest.mark.parametrize(("arch", "component"), CASES)
def test_an_original_layout_file_converts_exactly_and_diffusers_reads_the_same(tmp_path, tiny_models, arch,
                                                                               component):
    model, (original_key, prefixes, diffusers_reads) = tiny_models(arch), CASES[arch, component]
    tensors = original(model, component)
    assert original_key in tensors
    for prefix in prefixes:
        assert_same_tensors(convert_written(families.for_model(model), component, model, tensors, tmp_path, prefix),
                            folder_tensors(model, component))
    cls = getattr(diffusers, json.loads((model / component / "config.json").read_text())["_class_name"])
    for prefix in diffusers_reads:
        file = write_file(tensors, tmp_path / f"diffusers{prefix}.safetensors", prefix)
        assert_diffusers_reads_the_same(cls, file, model, component)


def test_wan_vae_writer_and_converter_agree_with_diffusers_at_the_published_depth(tmp_path):
    """diffusers' Wan VAE converter numbers the decoder for the published two residual blocks a
    level (the tiny models have one): at that depth, at a tiny width, diffusers reads the writer's
    file exactly and the family's size-free converter names every tensor as diffusers' does."""
    torch.manual_seed(0)
    diffusers.AutoencoderKLWan(base_dim=4, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                               temperal_downsample=[False, True, True]).save_pretrained(tmp_path / "model" / "vae")
    tensors = original(tmp_path / "model", "vae")
    assert {"decoder.upsamples.4.shortcut.weight", "decoder.upsamples.3.resample.1.weight"} <= tensors.keys()
    assert_diffusers_reads_the_same(diffusers.AutoencoderKLWan, write_file(tensors, tmp_path / "vae.safetensors"),
                                    tmp_path / "model", "vae")
    config = json.loads((tmp_path / "model" / "vae" / "config.json").read_text())
    assert_same_tensors(wan21_vae(dict(tensors), config), convert_wan_vae_to_diffusers(dict(tensors)))


def test_a_wan21_vae_file_over_a_wan22_5b_base_is_one_line(tmp_path, tiny_models):
    file = write_file(original(tiny_models("wan2.1"), "vae"), tmp_path / "wan21_vae.safetensors")
    model = tiny_models("wan2.2-5b")
    with pytest.raises(UserError, match=r"^model.vae: .*wan21_vae.safetensors is not a AutoencoderKLWan .*Wan 2.2's,"
                                        r" whose original layout diffusers does not convert"):
        convert_component(families.for_model(model), "vae", file, model, tmp_path / "vae", print)


def test_each_component_of_a_whole_ltx2_checkpoint_converts_exactly(tmp_path, tiny_models):
    """Lightricks' single checkpoint holds the transformer under ComfyUI's prefix and the VAE under `vae.`."""
    model = tiny_models("ltx2")
    whole = {**{COMFYUI_PREFIX + k: v for k, v in original(model, "transformer").items()},
             **{"vae." + k: v for k, v in original(model, "vae").items()}}
    checkpoint = write_file(whole, tmp_path / "ltx-2.safetensors")
    for component in ("transformer", "vae"):
        convert_component(families.for_model(model), component, checkpoint, model, tmp_path / component, print)
        assert_same_tensors(folder_tensors(tmp_path / component), folder_tensors(model, component))
