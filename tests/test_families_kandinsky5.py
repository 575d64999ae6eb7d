"""The Kandinsky 5 family against Kandinsky5T2IPipeline on the tiny offline text-to-image model: the
cached text records (Qwen2.5-VL's states at the caption's own tokens, CLIP's pooled vector) are what
encode_prompt makes, the normalised latents are what the pipelines' VAE encode makes, the denoiser
call is the pipeline's first, and evaluate renders at the size it asks for."""
from __future__ import annotations

import torch
from comfyui_keys import assert_comfyui_applies_the_merged_model
from family_checks import (CAPTIONS, assert_builds_byte_identically, assert_shift_is_the_schedulers, first_call,
                           keys_of, quiet_pipeline, text_records, tiny_model_fixture)

import lorapipe.stages.families as families
from lorapipe.stages.families import ObjectiveParams, TextOptions

model = tiny_model_fixture("kandinsky5")


def test_tiny_kandinsky5_builds_byte_identically_and_is_told_apart(model, tmp_path):
    files = assert_builds_byte_identically(model, "kandinsky5", tmp_path / "again")
    assert {"tokenizer/processor_config.json", "tokenizer_2/tokenizer_config.json",
            "text_encoder_2/model.safetensors"} <= set(files)
    family = families.for_model(model)
    assert (family.name, family.bound.name, family.bound.render_steps, family.bound.render_guidance) == (
        "kandinsky5", "5.0-t2i-lite", 50, 3.5)
    settings = family.text_settings(model, TextOptions(max_sequence_length=64))
    assert family.render_kwargs(settings, 3.5, "blurry") == {"guidance_scale": 3.5, "negative_prompt": "blurry",
                                                             "max_sequence_length": 64}


def test_text_records_are_encode_prompts_at_their_own_tokens(model):
    """Each record is encode_prompt's Qwen2.5-VL states (padded to the batch's longest on the right)
    at the caption's own tokens, and its CLIP pooled vector; the cleaning (HTML entities, spaces) is
    the pipeline's."""
    family, records, lengths, pooled = assert_records_are_encode_prompts(model, [*CAPTIONS, "a  cat &amp; a   dog"])
    cond = family.conditioning(records, [], ObjectiveParams())
    assert cond["encoder_attention_mask"].sum(1).tolist() == lengths
    assert torch.equal(cond["pooled_projections"], pooled)


def assert_records_are_encode_prompts(model, captions: list[str]):
    """Each caption's record is the pipeline's encode_prompt at the caption's own tokens (each of its
    own length) and its pooled vector: the family, the records, their lengths and the pooled vectors."""
    family, records = text_records(model, captions)
    with torch.no_grad():
        embeds, pooled, bounds = quiet_pipeline(model).encode_prompt(captions, device="cpu")
    lengths = bounds.diff().tolist()
    assert len(set(lengths)) == len(captions)
    for record, embed, vector, length in zip(records, embeds, pooled, lengths, strict=True):
        assert torch.equal(record["hidden_states"], embed[:length])
        assert torch.equal(record["pooled"], vector)
    return family, records, lengths, pooled


def test_normalised_latents_are_the_pipelines_vae_encode(model):
    """Kandinsky5I2IPipeline's VAE encode (the posterior sampled, times scaling_factor, the config's
    shift_factor left out) on the same image is the family's normalisation of the same sample."""
    from diffusers import Kandinsky5I2IPipeline

    family, pipe = families.for_model(model), Kandinsky5I2IPipeline(**quiet_pipeline(model).components)
    image = torch.rand(1, 3, 64, 48, generator=torch.Generator().manual_seed(3))
    mean, std = family.load_latent_encoder(model, "cpu")(image * 2 - 1)
    with torch.no_grad():
        latents = pipe.prepare_latents(image, 1, 16, 64, 48, torch.float32, "cpu", torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(0)
    torch.randn(latents.shape[:-1] + (16,), generator=generator)  # the noise the pipeline draws first
    sample = mean + std * torch.randn(mean.shape, generator=generator)
    assert pipe.vae.config.shift_factor != 0 and mean.shape == (1, 16, 8, 6)
    encoded = latents[..., 16:32].permute(0, 4, 1, 2, 3).squeeze(2)
    assert torch.allclose(family.latent_normalisation(model).apply(sample), encoded, atol=1e-6)


def test_denoiser_call_is_the_pipelines_and_each_text_length_runs_alone(model):
    """predict is the pipeline's first transformer call on one prompt (prepared by the family to render
    at 64 x 48 px); a batch whose texts differ in length predicts each row as that row alone (the
    transformer takes no text mask)."""
    family, pipe = families.for_model(model), quiet_pipeline(model)
    family.prepare_pipeline(pipe, family.sampler, family.objective(model, ObjectiveParams()))
    _, kwargs, output = first_call(pipe.transformer, lambda: pipe(
        CAPTIONS[0], num_inference_steps=2, height=64, width=48, guidance_scale=1.0,
        generator=torch.Generator().manual_seed(0), output_type="latent"))
    _, records = text_records(model, CAPTIONS)
    noisy = kwargs["hidden_states"].permute(0, 4, 1, 2, 3).squeeze(2)
    sigma = pipe.scheduler.sigmas[0].expand(1)
    with torch.no_grad():
        alone = [family.predict(pipe.transformer, noisy, sigma, family.conditioning([record], [], ObjectiveParams()),
                                torch.float32) for record in records]
        batch = family.predict(pipe.transformer, noisy.expand(3, -1, -1, -1), sigma.expand(3),
                               family.conditioning(records, [], ObjectiveParams()), torch.float32)
    assert noisy.shape == (1, 16, 8, 6)
    assert torch.equal(alone[0], output.sample.permute(0, 4, 1, 2, 3).squeeze(2))
    assert torch.equal(batch, torch.cat(alone))


def test_evaluate_renders_at_the_size_it_asks_for(model):
    """The pipeline renders a size outside its own list at the nearest of those; prepared by the
    family, at the size asked for."""
    family, pipe = families.for_model(model), quiet_pipeline(model)
    objective = family.objective(model, ObjectiveParams())
    family.prepare_pipeline(pipe, family.sampler, objective)
    image = pipe("a rocket", num_inference_steps=1, height=64, width=48, generator=torch.Generator().manual_seed(0),
                 **family.render_kwargs(family.text_settings(model, TextOptions()), 3.5, "")).image[0]
    assert image.size == (48, 64)
    assert_shift_is_the_schedulers(model, lambda tokens: None)


def test_comfyui_export_is_the_original_names_under_diffusion_model(model, exported_loras):
    """ComfyUI's Kandinsky 5 holds the original checkpoint's names, which are diffusers' module names:
    `diffusion_model.<name>.lora_A/lora_B.weight`, every key read, the merged model applied.
    (tests/test_families.py: the presets and the diffusers file.)"""
    transformer, _, written = exported_loras("kandinsky5")
    assert "diffusion_model.visual_transformer_blocks.0.cross_attention.to_key.lora_A.weight" in keys_of(written[1])
    assert_comfyui_applies_the_merged_model(written[1], transformer, families.for_model(model))
