"""The Krea 2 family against Krea2Pipeline on the tiny offline Krea 2: the cached text record (the
real tokens after the template's 34, the pipeline's select layers concatenated, unpadded) is what
inference encodes, the one-frame latents' per-channel normalisation and the denoiser call are the
pipeline's, the base shifts by resolution and the distilled checkpoint by its fixed mu, and both
LoRA exports load through Krea2Pipeline's own loader and mean what was trained."""
from __future__ import annotations

import math

import pytest
import torch
from comfyui_keys import assert_comfyui_applies_the_merged_model
from family_checks import CAPTIONS, EVERY_LINEAR, assert_builds_byte_identically, assert_means_what_was_trained, \
    assert_records_are_the_pipelines_at_their_own_tokens, first_step_predicted, fused_change, keys_of, quiet_pipeline, \
    text_records, tiny_model_fixture

import lorapipe.stages.families as families
from lorapipe.stages.families import ObjectiveParams, TextOptions


model = tiny_model_fixture("krea2")


def test_tiny_krea2_builds_byte_identically_and_its_variants_are_told_apart(model, tmp_path):
    assert "text_encoder/config.json" in assert_builds_byte_identically(model, "krea2", tmp_path / "again")
    family = families.for_model(model)
    assert (family.name, family.bound.name, family.geometry(model).pixel_multiple, family.variant.train_instead) == \
        ("krea2", "base", 16, None)
    assert family.text_settings(model, TextOptions()).hidden_layers == (1, 2, 4)  # model_index.json's
    distilled = families.for_model(families.build_tiny_model(tmp_path / "distilled", "krea2-distilled"))
    assert (distilled.bound.name, distilled.variant.render_guidance) == ("distilled", 0.0)
    assert "base" in distilled.variant.train_instead


def test_text_records_are_what_the_pipeline_encodes(model):
    """Each record is the pipeline's embeddings at its mask's tokens, layers concatenated; padded per
    batch, the family's mask marks each record's own tokens."""
    family, records = text_records(model, CAPTIONS)
    with torch.no_grad():
        embeds, mask = quiet_pipeline(model).encode_prompt(CAPTIONS, max_sequence_length=512)
    assert embeds.shape[2] == 3  # the select layers, concatenated:
    assert_records_are_the_pipelines_at_their_own_tokens(family, records, embeds.flatten(2), mask)


def test_latent_normalisation_is_the_pipelines(model):
    """The VAE's one frame normalised per channel: the inverse of what Krea2Pipeline decodes."""
    family, pipe = families.for_model(model), quiet_pipeline(model)
    pixels = torch.rand(2, 3, 64, 48, generator=torch.Generator().manual_seed(3)) * 2 - 1
    mean, std = family.load_latent_encoder(model, "cpu")(pixels)
    assert mean.shape == std.shape == (2, 4, 8, 6)
    config = pipe.vae.config
    with torch.no_grad():
        expected = pipe.vae.encode(pixels.unsqueeze(2)).latent_dist.mean.squeeze(2)
    latents_mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1)
    latents_std = torch.tensor(config.latents_std).view(1, -1, 1, 1)
    assert torch.allclose(mean, expected, atol=1e-6)
    normalised = family.latent_normalisation(model).apply(mean)
    assert torch.allclose(normalised * latents_std + latents_mean, mean, atol=1e-5)
    assert not torch.allclose(normalised, mean, atol=1e-2)


def test_denoiser_call_is_the_pipelines(model):
    """The pipeline pads its text in the middle to a fixed length, the family at the end to the
    batch's longest: the mask leaves the same tokens to attend, so the prediction agrees to rounding."""
    noisy, predicted, output, _, pipe = first_step_predicted(
        model, CAPTIONS[:2], lambda pipe, kwargs: pipe._unpack_latents(kwargs["hidden_states"], 64, 48).squeeze(2),
        height=64, width=48, guidance_scale=0.0)
    assert noisy.shape == (2, 4, 8, 6)
    assert torch.allclose(predicted, pipe._unpack_latents(output[0], 64, 48).squeeze(2), atol=1e-5)


def test_shift_is_the_pipelines(model, tmp_path):
    """Base: mu from the image's token count up to max_image_seq_len 6400; distilled: mu = 1.15."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.krea2.pipeline_krea2 import calculate_shift

    u = torch.tensor([0.9, 0.5, 0.1])
    objective = families.for_model(model).objective(model, ObjectiveParams())
    assert (objective.sampling.shift, objective.sampling.max_shift) == ("resolution", 1.15)
    distilled = tmp_path / "distilled"
    families.build_tiny_model(distilled, "krea2-distilled")
    fixed = families.for_model(distilled).objective(distilled, ObjectiveParams())
    for tokens in (12, 6400):
        for objective_, mu in ((objective, calculate_shift(tokens, 256, 6400, 0.5, 1.15)), (fixed, 1.15)):
            scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(model, subfolder="scheduler")
            scheduler.set_timesteps(sigmas=u.tolist(), mu=mu)
            assert torch.allclose(objective_.shifted(u, tokens), scheduler.sigmas[:-1])
    assert fixed.sampling.shift_value == pytest.approx(math.exp(1.15))


def test_comfyui_export_is_in_krea_names_and_loads_in_diffusers(model, exported_loras):
    """`diffusion_model.<Krea's name>.lora_A/lora_B.weight`, the scale in lora_B: read by
    Krea2Pipeline's own non-diffusers converter, every module (text fusion, embedders) included."""
    transformer, targets, written = exported_loras("krea2", EVERY_LINEAR)
    keys = keys_of(written[1])
    assert {"diffusion_model.blocks.0.attn.wq.lora_A.weight", "diffusion_model.blocks.1.mlp.down.lora_B.weight",
            "diffusion_model.txtfusion.refiner_blocks.0.attn.gate.lora_A.weight",
            "diffusion_model.txtfusion.projector.lora_A.weight", "diffusion_model.tproj.1.lora_B.weight"} <= keys
    assert len(keys) == 2 * len(targets) and not any(k.endswith(".alpha") for k in keys)
    assert_means_what_was_trained(transformer, targets, fused_change(quiet_pipeline(model), "transformer", written[1]))
    assert_comfyui_applies_the_merged_model(written[1], transformer, families.for_model(model))
