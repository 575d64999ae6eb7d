"""Single-file (A1111/ComfyUI) base models: the shipped architecture configs, family detection,
identity by content, and the conversion to a diffusers folder, on the tiny SD1.5 model written out
in the original (LDM) layout by tests/original_layouts/sd.py (diffusers ships only LDM -> diffusers).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from original_layouts.sd import write_ldm_checkpoint
from safetensors.torch import load_file, save_file

from lorapipe.cache.digest import StatCache, digest_file
from lorapipe.stages import families
from lorapipe.stages.families.single_file import ARCH_ROOT
from lorapipe.stages.models import component_digests


def model_family(path: Path, declared: str | None = None) -> str:
    return families.for_model(path, declared).name


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
    checkpoint = write_ldm_checkpoint(tiny_model, tmp_path / "tiny.safetensors", families.get("sd15"))
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
