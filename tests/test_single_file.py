"""Single-file (A1111/ComfyUI) base models: the shipped architecture configs, family detection,
identity by content, and the conversion to a diffusers folder, on the tiny SD1.5 model written out
in the original (LDM) layout by the converter below (diffusers ships only LDM -> diffusers).

The converter generalises the retired diffusers script convert_diffusers_to_original_stable_diffusion.py
to any number of levels and layers per block. It covers SD1.x (one CLIP text encoder); SDXL's second
text encoder is stored in OpenCLIP's layout, which it does not write.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lorapipe.cache.digest import StatCache, digest_file
from lorapipe.stages import families
from lorapipe.stages.families.ldm_names import ldm_name, renamed, unet_block_prefixes
from lorapipe.stages.families.single_file import ARCH_ROOT
from lorapipe.stages.models import component_digests


def model_family(path: Path, declared: str | None = None) -> str:
    return families.for_model(path, declared).name


def unet_to_ldm(state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    blocks = unet_block_prefixes(config)
    return {"model.diffusion_model." + ldm_name(key, blocks): value for key, value in state.items()}


def vae_to_ldm(state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    levels, per = len(config["block_out_channels"]), config["layers_per_block"]
    pairs = [("encoder.mid.attn_1.", "encoder.mid_block.attentions.0."), ("decoder.mid.attn_1.", "decoder.mid_block.attentions.0.")]
    for side in ("encoder", "decoder"):
        pairs += [(f"{side}.mid.block_{j + 1}.", f"{side}.mid_block.resnets.{j}.") for j in range(2)]
        pairs += [(f"{side}.norm_out.", f"{side}.conv_norm_out.")]
    for i in range(levels):
        pairs += [(f"encoder.down.{i}.block.{j}.", f"encoder.down_blocks.{i}.resnets.{j}.") for j in range(per)]
        pairs += [(f"decoder.up.{levels - 1 - i}.block.{j}.", f"decoder.up_blocks.{i}.resnets.{j}.") for j in range(per + 1)]
        if i < levels - 1:
            pairs += [(f"encoder.down.{i}.downsample.", f"encoder.down_blocks.{i}.downsamplers.0."),
                      (f"decoder.up.{levels - 1 - i}.upsample.", f"decoder.up_blocks.{i}.upsamplers.0.")]
    parts = [("nin_shortcut.", "conv_shortcut."), ("norm.", "group_norm."), ("q.", "to_q."), ("k.", "to_k."),
             ("v.", "to_v."), ("proj_out.", "to_out.0.")]
    out = {}
    for key, value in state.items():
        new = key
        for ldm, hf in pairs:
            if key.startswith(hf):
                rest = key[len(hf):]
                new = ldm + (renamed(rest, parts) or rest)
                if ".attn_1." in ldm and rest.split(".")[0].startswith(("to_", "proj")) and value.ndim == 2:
                    value = value[:, :, None, None]
                break
        out["first_stage_model." + new] = value
    return out


def text_to_ldm(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"cond_stage_model.transformer.text_model." + k.removeprefix("text_model."): v for k, v in state.items()
            if not k.endswith("position_ids")}


def write_ldm_checkpoint(model_dir: Path, path: Path) -> Path:
    """A tiny SD1.x diffusers folder as one A1111-style `.safetensors` file."""
    read = lambda sub: load_file(next((model_dir / sub).glob("*.safetensors")))  # noqa: E731
    config = lambda sub: json.loads((model_dir / sub / "config.json").read_text())  # noqa: E731
    tensors = {**unet_to_ldm(read("unet"), config("unet")), **vae_to_ldm(read("vae"), config("vae")),
               **text_to_ldm(read("text_encoder"))}
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    return path


def test_shipped_architectures_have_the_published_parameter_counts():
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    count = lambda model: sum(p.numel() for p in model.parameters())  # noqa: E731
    with init_empty_weights():
        for family, unet in (("sd15", 859_520_964), ("sdxl", 2_567_463_684)):
            arch = ARCH_ROOT / family
            assert count(UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(arch / "unet"))) == unet
            assert count(AutoencoderKL.from_config(AutoencoderKL.load_config(arch / "vae"))) == 83_653_863
            assert count(CLIPTextModel(CLIPTextConfig.from_pretrained(arch / "text_encoder"))) == 123_060_480
        config = CLIPTextConfig.from_pretrained(ARCH_ROOT / "sdxl" / "text_encoder_2")
        assert count(CLIPTextModelWithProjection(config)) == 694_659_840
    assert model_family(ARCH_ROOT / "sd15") == "sd15" and model_family(ARCH_ROOT / "sdxl") == "sdxl"


def test_single_file_checkpoint_loads_as_the_model_it_came_from(tmp_path, tiny_model):
    checkpoint = write_ldm_checkpoint(tiny_model, tmp_path / "tiny.safetensors")
    assert model_family(checkpoint) == "sd15"
    with StatCache(tmp_path / "stat.sqlite") as stats:
        digests = component_digests(checkpoint, stats, families.for_model(checkpoint))
    assert set(digests) == {"scheduler", "text_encoder", "tokenizer", "unet", "vae"}
    assert set(digests.values()) == {digest_file(checkpoint)}  # identity is the file's content
    arch = tmp_path / "arch"  # the tiny architecture's configs and tokenizer, no weights
    shutil.copytree(tiny_model, arch, ignore=shutil.ignore_patterns("*.safetensors"))
    sd15 = families.get("sd15")
    folder = families.single_file_folder(sd15, checkpoint, "d1", tmp_path / "models", arch_dir=arch)
    assert folder == tmp_path / "models" / "d1" and model_family(folder) == "sd15"
    for part in ("unet", "vae", "text_encoder"):
        ours, original = (load_file(next((root / part).glob("*.safetensors"))) for root in (folder, tiny_model))
        assert ours.keys() == original.keys(), part
        assert all(torch.equal(ours[k].reshape(original[k].shape), original[k]) for k in ours), part
    assert families.single_file_folder(sd15, checkpoint, "d1", tmp_path / "models", arch_dir=arch) == folder


def test_family_detection_and_refusals(tmp_path, tiny_model):
    save_file({"model.diffusion_model.label_emb.0.0.weight": torch.zeros(1)}, tmp_path / "xl.safetensors")
    assert model_family(tmp_path / "xl.safetensors") == "sdxl"
    assert model_family(tmp_path / "xl.safetensors", "sd15") == "sd15"  # model.family wins
    save_file({"lora_unet_x.alpha": torch.zeros(1)}, tmp_path / "lora.safetensors")
    with pytest.raises(ValueError, match="holds none of the tensors that identify"):
        model_family(tmp_path / "lora.safetensors")
    with pytest.raises(ValueError, match="model.family is sdxl"):
        model_family(tiny_model, "sdxl")
    with pytest.raises(FileNotFoundError, match="no vocab.json/merges.txt"):  # the CLIP vocabulary is not shipped
        families.single_file_folder(families.get("sdxl"), tmp_path / "xl.safetensors", "d", tmp_path / "models")
