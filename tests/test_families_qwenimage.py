"""The Qwen-Image family against QwenImagePipeline on the tiny offline Qwen-Image: the cached text
record (the caption's tokens after the system template's 34, unpadded) padded per batch by the
family is what inference encodes, the one-frame latents' per-channel normalisation and the denoiser
call are the pipeline's, the shift comes from the scheduler config, and both LoRA exports load
through QwenImagePipeline's own loader and mean what was trained."""
from __future__ import annotations


import pytest
import torch
from comfyui_keys import assert_comfyui_applies_the_merged_model, comfyui_unread
from family_checks import CAPTIONS, assert_builds_byte_identically, assert_means_what_was_trained, \
    assert_padded_per_batch_as_the_pipeline, assert_resolution_shift_is_the_pipelines, first_step_predicted, \
    fused_change, keys_of, quiet_pipeline, text_records, tiny_model_fixture

import lorapipe.stages.families as families
from lorapipe.stages.families import TextOptions


model = tiny_model_fixture("qwen-image")


def test_tiny_qwen_image_builds_byte_identically_and_loads(model, tmp_path):
    assert "text_encoder/config.json" in assert_builds_byte_identically(model, "qwen-image", tmp_path / "again")
    family = families.for_model(model)
    assert (family.name, family.variant.train_instead) == ("qwen-image", None)
    assert family.geometry(model).pixel_multiple == 16
    with pytest.raises(ValueError, match="encode.max_sequence_length: Qwen-Image reads at most 1024"):
        family.text_settings(model, TextOptions(max_sequence_length=2048))


@pytest.mark.parametrize("captions", [CAPTIONS, CAPTIONS[:1]])
def test_text_records_are_what_the_pipeline_encodes(model, captions):
    """Unpadded records; padded per batch they are the pipeline's embeddings and mask, and the mask is
    left out, as the pipeline leaves it out, when nothing in the batch is padded."""
    family, records = text_records(model, captions)
    with torch.no_grad():
        embeds, mask = quiet_pipeline(model).encode_prompt(list(captions), max_sequence_length=512)
    assert_padded_per_batch_as_the_pipeline(family, records, embeds, mask)


def test_latent_normalisation_is_the_pipelines(model):
    """The video VAE's one frame, squeezed into (C, H, W) records, normalised per channel as the
    Qwen-Image img2img pipeline does on (B, C, 1, H, W)."""
    from diffusers import QwenImageImg2ImgPipeline

    family, pipe = families.for_model(model), quiet_pipeline(model)
    pixels = torch.rand(2, 3, 64, 48, generator=torch.Generator().manual_seed(3)) * 2 - 1
    mean, std = family.load_latent_encoder(model, "cpu")(pixels)
    assert mean.shape == std.shape == (2, 4, 8, 6)
    normalise = family.latent_normalisation(model)
    sample = mean + std * torch.randn(mean.shape, generator=torch.Generator().manual_seed(5))
    img2img = QwenImageImg2ImgPipeline(**pipe.components)
    with torch.no_grad():
        expected = img2img._encode_vae_image(pixels.unsqueeze(2), torch.Generator().manual_seed(5))
    assert torch.allclose(normalise.apply(sample), expected.squeeze(2), atol=1e-6)


def unpacked(pipe, tokens: torch.Tensor) -> torch.Tensor:
    return pipe._unpack_latents(tokens, 64, 48, pipe.vae_scale_factor).squeeze(2)


def test_denoiser_call_is_the_pipelines(model):
    noisy, predicted, output, _, pipe = first_step_predicted(
        model, CAPTIONS[:2], lambda pipe, kwargs: unpacked(pipe, kwargs["hidden_states"]), height=64, width=48,
        true_cfg_scale=1.0)
    assert noisy.shape == (2, 4, 8, 6)
    assert torch.equal(predicted, unpacked(pipe, output[0]))


def test_shift_is_the_schedulers(model):
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    assert_resolution_shift_is_the_pipelines(model, calculate_shift, 256, 4096, 0.5, 0.9)


def test_comfyui_export_loads_in_diffusers_and_comfyui(model, exported_loras):
    """`diffusion_model.<name>.lora_A/lora_B.weight`, the scale in lora_B and no `.alpha`: read by
    QwenImagePipeline's own non-diffusers converter as it is, and by ComfyUI; both apply the trained
    model. ComfyUI also reads every key of the diffusers file (its Qwen-Image key map takes
    `transformer.<name>`), but with no adapter config, at scale 1 instead of alpha / rank.
    (tests/test_families.py: the presets and the diffusers file.)"""
    transformer, targets, written = exported_loras("qwen-image")
    keys = keys_of(written[1])
    assert "diffusion_model.transformer_blocks.0.attn.to_q.lora_A.weight" in keys
    assert not any(k.endswith(".alpha") for k in keys)
    assert_means_what_was_trained(transformer, targets, fused_change(quiet_pipeline(model), "transformer", written[1]))
    assert_comfyui_applies_the_merged_model(written[1], transformer, families.for_model(model))
    assert not comfyui_unread(written[0], transformer, families.for_model(model))
