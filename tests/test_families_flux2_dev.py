"""The Flux.2-dev family against Flux2Pipeline on the tiny offline Flux.2-dev: the cached text record
(the pipeline's system message in the processor's chat template, three Mistral3 layers, every
position) is what inference encodes, the latents are Klein's batch-norm normalisation as the
pipeline encodes them, and the denoiser call, guidance included, is the pipeline's."""
from __future__ import annotations

import pytest
import torch
from family_checks import (CAPTIONS, assert_builds_byte_identically, assert_shift_is_the_schedulers, first_call,
                           quiet_pipeline, text_records, tiny_model_fixture)

import lorapipe.stages.families as families
from lorapipe.stages.families import ObjectiveParams, TextOptions

dev = tiny_model_fixture("flux2-dev")


def test_tiny_dev_builds_byte_identically_and_templates_as_mistral(dev, tmp_path):
    files = assert_builds_byte_identically(dev, "flux2-dev", tmp_path / "again")
    assert "tokenizer/chat_template.jinja" in files
    family = families.for_model(dev)
    assert (family.name, family.bound.name, family.bound.render_steps, family.bound.render_guidance) == (
        "flux2-dev", "dev", 50, 4.0)
    encoder = family.text_encoder(dev, family.text_settings(dev, TextOptions()), torch.float32, "cpu")
    assert encoder.templated("A cat [IMG]!") == (
        "<s>[SYSTEM_PROMPT]You are an AI that reasons about image descriptions. You give structured responses"
        " focusing on object relationships, object\nattribution and actions without speculation."
        "[/SYSTEM_PROMPT][INST]A cat ![/INST]")


def test_text_records_are_what_the_pipeline_encodes(dev):
    """The processor's bos is written by the template and added once; `[IMG]` is dropped as the
    pipeline's format_input drops it."""
    captions = [*CAPTIONS, "a [IMG] rocket"]
    family, records = text_records(dev, captions)
    with torch.no_grad():
        embeds, _ = quiet_pipeline(dev).encode_prompt(captions, max_sequence_length=512)
    assert embeds.shape == (4, 512, 48)
    for record, embed in zip(records, embeds, strict=True):
        assert torch.equal(record["hidden_states"], embed)
    settings = family.text_settings(dev, TextOptions(max_sequence_length=64))
    assert (settings.hidden_layers, settings.max_sequence_length) == ((10, 20, 30), 64)
    assert family.render_kwargs(settings, 4.0, "") == {"guidance_scale": 4.0, "max_sequence_length": 64,
                                                       "text_encoder_out_layers": (10, 20, 30)}
    with pytest.raises(ValueError, match="evaluate.negative_prompt: Flux.2-dev is guidance-distilled"):
        family.render_kwargs(settings, 4.0, "blurry")


def test_latent_normalisation_is_the_pipelines(dev):
    family, pipe = families.for_model(dev), quiet_pipeline(dev)
    pixels = torch.rand(2, 3, 64, 48, generator=torch.Generator().manual_seed(3)) * 2 - 1
    mean, _ = family.load_latent_encoder(dev, "cpu")(pixels)
    with torch.no_grad():
        expected = pipe._encode_vae_image(pixels, torch.Generator().manual_seed(0))  # the posterior's mode
    assert expected.shape == (2, 32, 4, 3)
    assert torch.allclose(family.latent_normalisation(dev).apply(mean), expected, atol=1e-6)


def test_denoiser_call_is_the_pipelines_guidance_included(dev):
    """train.guidance reaches the transformer as Flux2Pipeline's guidance_scale does."""
    family, pipe = families.for_model(dev), quiet_pipeline(dev)
    _, kwargs, output = first_call(pipe.transformer, lambda: pipe(
        prompt=CAPTIONS[:2], num_inference_steps=2, height=64, width=48, guidance_scale=2.5, max_sequence_length=64,
        generator=torch.Generator().manual_seed(0), output_type="latent"))
    _, records = text_records(dev, CAPTIONS[:2], TextOptions(max_sequence_length=64))
    noisy = pipe._unpack_latents_with_ids(kwargs["hidden_states"], kwargs["img_ids"])
    sigma = pipe.scheduler.sigmas[0].expand(2)
    with torch.no_grad():
        predicted, unguided = (family.predict(pipe.transformer, noisy, sigma, family.conditioning(
            records, [], ObjectiveParams(guidance=guidance)), torch.float32) for guidance in (2.5, 1.0))
    assert kwargs["guidance"].tolist() == [2.5, 2.5] and noisy.shape == (2, 32, 4, 3)
    assert torch.equal(predicted, pipe._unpack_latents_with_ids(output[0], kwargs["img_ids"]))
    assert not torch.allclose(unguided, predicted, atol=1e-4)
    family.check_objective(ObjectiveParams(guidance=2.5))  # the dev transformer has the guidance input


def test_shift_is_the_pipelines_empirical_mu(dev):
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    objective = assert_shift_is_the_schedulers(dev, lambda tokens: compute_empirical_mu(tokens, 50))
    assert (objective.sampling.shift, objective.sampling.shift_steps) == ("empirical", 50)

