"""The HunyuanVideo 1.5 family against HunyuanVideo15Pipeline on the tiny offline text-to-video model:
the cached text records (Qwen2.5-VL's and, for quoted text, ByT5's, each at its own tokens) are what
encode_prompt makes, the latents' normalisation is what the pipeline inverts before decoding, and the
denoiser call is the pipeline's first."""
from __future__ import annotations

import pytest
import torch
from family_checks import assert_builds_byte_identically, assert_only_the_guiders_scale_renders, \
    assert_text_and_glyph_records_are_encode_prompts, encoded_clip, first_call, quiet_pipeline, text_records, \
    tiny_model_fixture

import lorapipe.stages.families as families
from lorapipe.stages.families import ObjectiveParams

CAPTIONS = ['a sign that says "hello" on a wall', "a rocket", ""]  # the first quotes text for ByT5

model = tiny_model_fixture("hunyuanvideo1.5")


def test_tiny_hunyuanvideo15_builds_byte_identically_and_is_told_apart(model, tmp_path):
    files = assert_builds_byte_identically(model, "hunyuanvideo1.5", tmp_path / "again")
    assert {"text_encoder_2/model.safetensors", "tokenizer_2/tokenizer_config.json",
            "guider/guider_config.json"} <= set(files)
    family = families.for_model(model)
    assert (family.name, family.variant.tiny_arch, family.temporal_compression(model)) == \
        ("hunyuanvideo1.5", "hunyuanvideo1.5", 4)
    assert (family.geometry(model).downsampling, family.sampler) == (16, "flow_match_euler")


def test_text_records_are_encode_prompts_at_their_own_tokens(model):
    assert_text_and_glyph_records_are_encode_prompts(model, CAPTIONS)


def test_latents_and_their_normalisation_are_the_pipelines(model):
    """A 5-frame clip through the family's encoder is the VAE's posterior (C, F', H', W'), in a batch
    too (which diffusers' VAE itself fails on); normalised, it is what the pipeline turns back into
    the VAE's latents before decoding (the decoder's first input, after one step at sigma 0, which
    leaves the latents as they are)."""
    pipe = quiet_pipeline(model)
    family, encoder, clip, mean = encoded_clip(model, pipe, 5, 32, 48)
    assert mean.shape == (1, 4, 2, 2, 3)
    assert torch.equal(encoder(torch.cat([-clip, clip]))[0][1:], mean)  # a batch: each clip as if alone
    normalised = family.latent_normalisation(model).apply(mean)
    args, _, _ = first_call(pipe.vae.decoder.conv_in, lambda: pipe(
        "a cat", latents=normalised, sigmas=[0.0], num_inference_steps=1, height=32, width=48, num_frames=5,
        output_type="pt"))
    assert torch.allclose(args[0], mean, atol=1e-6)


@pytest.mark.parametrize("captions", [CAPTIONS[:2], CAPTIONS[1:2]])
def test_denoiser_call_is_the_pipelines(model, captions):
    """family.predict on the pipeline's first noisy latents, the cached records padded per batch and
    sigma = t / 1000 is the pipeline's first (conditional) transformer call: the same timestep and
    prediction, though the pipeline pads its texts to their full lengths."""
    family, pipe = families.for_model(model), quiet_pipeline(model)
    _, kwargs, output = first_call(pipe.transformer, lambda: pipe(
        captions, num_inference_steps=2, height=32, width=32, num_frames=5,
        generator=torch.Generator().manual_seed(0), output_type="latent"))
    cond = family.conditioning(text_records(model, captions)[1], [], ObjectiveParams())
    noisy, predicted = kwargs["hidden_states"][:, :4], []
    with torch.no_grad():
        _, ours, _ = first_call(pipe.transformer, lambda: predicted.append(
            family.predict(pipe.transformer, noisy, kwargs["timestep"] / 1000, cond, torch.float32)))
    assert torch.equal(ours["hidden_states"], kwargs["hidden_states"])
    assert torch.allclose(ours["timestep"], kwargs["timestep"])
    assert torch.allclose(predicted[0], output[0], atol=1e-5)


def test_a_guidance_scale_other_than_the_guiders_is_refused(model):
    assert_only_the_guiders_scale_renders(model, 6.0)


def test_comfyui_export_is_hunyuanvideos_names_read_by_diffusers_and_comfyui(model, exported_loras):
    """HunyuanVideo's original names under `diffusion_model.` (double_blocks.N.img_attn_qkv, q|k|v fused;
    img_mlp.fc1; img_mod.linear), the scale in lora_B and no `.alpha`: diffusers' HunyuanVideo LoRA loader
    (the one evaluate gives the pipeline) and ComfyUI's key map for its HunyuanVideo models both apply
    the trained model."""
    from comfyui_keys import assert_comfyui_applies_the_merged_model
    from family_checks import assert_means_what_was_trained, fused_change, keys_of, quiet_pipeline

    transformer, targets, written = exported_loras("hunyuanvideo1.5")
    keys = keys_of(written[1])
    assert {"diffusion_model.double_blocks.0.img_attn_qkv.lora_A.weight",
            "diffusion_model.double_blocks.1.txt_mlp.fc2.lora_B.weight",
            "diffusion_model.double_blocks.1.img_mod.linear.lora_A.weight"} <= keys
    assert not any(key.endswith(".alpha") for key in keys)
    family, pipe = families.for_model(model), quiet_pipeline(model)
    family.prepare_pipeline(pipe, family.sampler, None)
    assert_means_what_was_trained(transformer, targets, fused_change(pipe, "transformer", written[1]))
    assert_comfyui_applies_the_merged_model(written[1], transformer, family)
