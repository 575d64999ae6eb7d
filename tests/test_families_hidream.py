"""The HiDream-I1 family against HiDreamImagePipeline on the tiny offline HiDream-I1 Full: the cached
text record (both CLIPs' pooled embeddings, T5's and the Llama's layers, padded) is what inference
encodes, the latents are Flux.1's VAE normalisation, the denoiser call (patchified by the
transformer, padded for a non-square image) is the pipeline's in inference and training mode, the
variants render with their folders' schedulers, and the ComfyUI file loads in diffusers and
ComfyUI."""
from __future__ import annotations

import shutil

import pytest
import torch
from comfyui_keys import assert_comfyui_applies_the_merged_model
from family_checks import (CAPTIONS, COMFYUI_FILE, assert_builds_byte_identically, assert_means_what_was_trained,
                           first_call, fused_change, keys_of, quiet_pipeline, text_records, tiny_model_fixture)

import lorapipe.stages.families as families
from lorapipe.stages.families import ObjectiveParams, TextOptions

full = tiny_model_fixture("hidream-i1")


def test_tiny_full_builds_byte_identically_and_variants_are_their_schedulers(full, tmp_path):
    from diffusers import FlowMatchEulerDiscreteScheduler

    files = assert_builds_byte_identically(full, "hidream-i1", tmp_path / "again")
    assert "tokenizer_4/tokenizer.json" in files
    family = families.for_model(full)
    assert (family.bound.name, family.sampler, family.bound.render_steps, family.bound.render_guidance) == (
        "full", "flow_unipc", 50, 5.0)
    assert family.objective(full, ObjectiveParams()).sampling.shift_value == 3.0  # UniPC's flow_shift
    for shift, name, steps in ((6.0, "dev", 28), (3.0, "fast", 16)):
        variant = shutil.copytree(full, tmp_path / name)
        shutil.rmtree(variant / "scheduler")
        FlowMatchEulerDiscreteScheduler(shift=shift).save_pretrained(variant / "scheduler")
        distilled = families.for_model(variant)
        assert (distilled.bound.name, distilled.sampler, distilled.bound.render_steps, distilled.bound.distilled) == (
            name, "flow_match_euler", steps, True)
        assert distilled.objective(variant, ObjectiveParams()).sampling.shift_value == shift
        with pytest.raises(ValueError, match=f"evaluate.negative_prompt: HiDream-I1 {name} renders without guidance"):
            distilled.render_kwargs(distilled.text_settings(variant, TextOptions()), 0.0, "blurry")


def test_text_records_are_what_the_pipeline_encodes(full):
    """Every caption's record is the pipeline's, padding included; the Llama's layers up to the
    last the transformer reads (0, 1, 2, 2: three of them)."""
    family, records = text_records(full, CAPTIONS)
    with torch.no_grad():
        t5, _, llama, _, pooled, _ = quiet_pipeline(full).encode_prompt(CAPTIONS, do_classifier_free_guidance=False)
    assert (pooled.shape, t5.shape, llama.shape) == ((3, 48), (3, 128, 32), (3, 3, 128, 16))
    for i, record in enumerate(records):
        assert torch.equal(record["pooled"], pooled[i]) and torch.equal(record["t5_states"], t5[i])
        assert torch.equal(record["llama_states"], llama[:, i])
    settings = family.text_settings(full, TextOptions(max_sequence_length=300))
    assert (settings.max_sequence_length, settings.clip_length, settings.llama_layers) == (300, 218, 3)
    assert family.render_kwargs(settings, 5.0, "blurry") == {"guidance_scale": 5.0, "negative_prompt": "blurry",
                                                            "max_sequence_length": 300}


def test_latent_normalisation_is_flux1s_the_pipeline_decodes(full):
    family, pipe = families.for_model(full), quiet_pipeline(full)
    pixels = torch.rand(1, 3, 64, 48, generator=torch.Generator().manual_seed(3)) * 2 - 1
    mean, _ = family.load_latent_encoder(full, "cpu")(pixels)
    normalise = family.latent_normalisation(full)
    assert (normalise.scale, normalise.shift) == (pipe.vae.config.scaling_factor, pipe.vae.config.shift_factor)
    with torch.no_grad():
        expected = (pipe.vae.encode(pixels).latent_dist.mode() - normalise.shift) * normalise.scale
    assert torch.allclose(normalise.apply(mean), expected, atol=1e-6)


def test_denoiser_call_is_the_pipelines_at_the_area_asked_for(full):
    """The prepared pipeline renders at evaluate's size (its own area would be 64 x 64 latents here);
    predict is its transformer's first call, on a square and a non-square image, and the same in
    training mode, where the transformer returns its tokens otherwise (a non-square image's padded
    to max_seq)."""
    family, pipe = families.for_model(full), quiet_pipeline(full)
    family.prepare_pipeline(pipe, family.sampler, family.objective(full, ObjectiveParams()))
    cond = family.conditioning(text_records(full, CAPTIONS[:2])[1], [], ObjectiveParams())
    for height, width in ((64, 64), (64, 48)):
        _, kwargs, output = first_call(pipe.transformer, lambda: pipe(
            CAPTIONS[:2], num_inference_steps=2, height=height, width=width, guidance_scale=1.0,
            generator=torch.Generator().manual_seed(0), output_type="latent", max_area=height * width))
        noisy, sigma = kwargs["hidden_states"], kwargs["timesteps"] / 1000
        assert noisy.shape == (2, 16, height // 8, width // 8)
        with torch.no_grad():
            predicted = family.predict(pipe.transformer, noisy, sigma, cond, torch.float32)
            assert torch.equal(predicted, -output[0])
            pipe.transformer.train()
            training = family.predict(pipe.transformer, noisy, sigma, cond, torch.float32)
            pipe.transformer.eval()
        assert torch.allclose(training, predicted, atol=1e-5)


def test_comfyui_export_loads_in_diffusers_and_comfyui(full, exported_loras):
    """diffusers' names under `diffusion_model.` (the original ones: diffusers' HiDream converter keeps
    them), the routed experts' too: HiDreamImagePipeline.load_lora_weights and ComfyUI both apply the
    trained model."""
    family = families.for_model(full)
    transformer, targets, written = exported_loras("hidream-i1")
    comfy = written[1]
    assert comfy.name == COMFYUI_FILE
    assert keys_of(comfy) == {f"diffusion_model.{t}.lora_{ab}.weight" for t in targets for ab in "AB"}
    assert "double_stream_blocks.0.block.ff_i.experts.3.w2" in targets
    assert_means_what_was_trained(transformer, targets, fused_change(quiet_pipeline(full), "transformer", comfy))
    assert_comfyui_applies_the_merged_model(comfy, transformer, family)
