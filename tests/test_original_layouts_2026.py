"""The original-layout writers of the 2026 families and the video VAEs (tests/original_layouts/):
each writes a tiny model's component as the single file people have (the model authors' names,
ComfyUI's `model.diffusion_model.` prefix or LTX-2's `vae.`), and diffusers' own single-file loader,
`<Class>.from_single_file`, reads it back to exactly the folder's weights. Ideogram 4 has no
diffusers single-file loader to check against; its file holds the diffusers names."""
from __future__ import annotations

import json
from pathlib import Path

import diffusers
import pytest
import torch
from original_layouts import krea2, ltx2, qwenimage, wan, zimage
from original_layouts.renaming import COMFYUI_PREFIX, State, prefixed
from safetensors.torch import load_file, save_file

WRITERS = {**zimage.WRITERS, **qwenimage.WRITERS, **krea2.WRITERS, **wan.WRITERS, **ltx2.WRITERS}
BOTH_PREFIXES = ("", COMFYUI_PREFIX)
ORIGINAL_KEY = {  # (arch, component) -> a key only the original layout has
    ("z-image", "transformer"): "layers.0.attention.qkv.weight",
    ("qwen-image", "transformer"): "transformer_blocks.0.img_mlp.net.0.proj.weight",  # diffusers' names
    ("qwen-image-2.1", "transformer"): "transformer_blocks.0.img_mlp.gate_up.weight",
    ("krea2", "transformer"): "blocks.0.attn.wq.weight",
    ("wan2.1", "transformer"): "blocks.0.norm3.weight",
    ("wan2.1-i2v", "transformer"): "blocks.0.cross_attn.k_img.weight",
    ("wan2.2-5b", "transformer"): "head.modulation",
    ("wan2.2-a14b", "transformer_2"): "blocks.1.self_attn.o.weight",
    ("wan2.2-i2v-a14b", "transformer_2"): "blocks.1.ffn.0.weight",
    ("ltx2", "transformer"): "adaln_single.emb.timestep_embedder.linear_1.weight",
    ("ltx2", "vae"): "encoder.down_blocks.8.res_blocks.0.conv1.conv.weight",
}
PREFIXES = {"qwen-image": ("",), "vae": ("", "vae.")}  # diffusers reads Qwen-Image's names bare only
CASES = [(arch, component, prefix) for arch, component in ORIGINAL_KEY
         for prefix in PREFIXES.get(arch, PREFIXES.get(component, BOTH_PREFIXES))]


def folder_weights(component: Path) -> State:
    return {key: value for file in sorted(component.glob("*.safetensors")) for key, value in load_file(file).items()}


def write_original(component: Path, prefix: str, file: Path) -> Path:
    """The component folder's weights as one file in its original layout, keys under `prefix`."""
    config = json.loads((component / "config.json").read_text())
    original = WRITERS[config["_class_name"]](folder_weights(component), config)
    save_file({key: value.contiguous() for key, value in prefixed(original, prefix).items()}, file)
    return file


def assert_reads_exactly(model: torch.nn.Module, weights: State) -> None:
    loaded = model.state_dict()
    assert loaded.keys() == weights.keys()
    assert all(torch.equal(loaded[key], value) for key, value in weights.items()), \
        [key for key, value in weights.items() if not torch.equal(loaded[key], value)][:3]


@pytest.mark.parametrize(("arch", "component", "prefix"), CASES)
def test_original_layout_file_loads_through_diffusers_as_the_folder(arch, component, prefix, tiny_models, tmp_path):
    folder = tiny_models(arch)
    file = write_original(folder / component, prefix, tmp_path / "original.safetensors")
    assert prefix + ORIGINAL_KEY[arch, component] in load_file(file)
    model_class = getattr(diffusers, json.loads((folder / component / "config.json").read_text())["_class_name"])
    assert_reads_exactly(model_class.from_single_file(str(file), config=str(folder), subfolder=component),
                         folder_weights(folder / component))


def test_wan_vae_original_layout_loads_through_diffusers(tmp_path):
    """diffusers' Wan VAE converter numbers the decoder's flat list for the published two residual
    blocks per level (the tiny models have one), so the writer is checked on the published layout at
    a tiny width."""
    torch.manual_seed(0)
    published = diffusers.AutoencoderKLWan(base_dim=4, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                                           temperal_downsample=[False, True, True])
    published.save_pretrained(tmp_path / "vae")
    file = write_original(tmp_path / "vae", "", tmp_path / "original.safetensors")
    assert {"decoder.upsamples.4.shortcut.weight", "decoder.upsamples.3.resample.1.weight"} <= load_file(file).keys()
    assert_reads_exactly(diffusers.AutoencoderKLWan.from_single_file(str(file), config=str(tmp_path / "vae")),
                         folder_weights(tmp_path / "vae"))
