"""The Ideogram 4 family against Ideogram4Pipeline on the tiny offline Ideogram 4: the cached text
record (the caption's own tokens, the pipeline's 13 tapped layers interleaved, unpadded) is what
inference encodes, the patch-major batch-normalised latents are what the pipeline decodes, the
conditional transformer's call is the pipeline's, and both LoRA exports load through
Ideogram4Pipeline's own loader and mean what was trained."""
from __future__ import annotations

import math

import pytest
import torch
from family_checks import CAPTIONS, assert_builds_byte_identically, assert_means_what_was_trained, \
    assert_records_are_the_pipelines_at_their_own_tokens, first_call, fused_change, keys_of, quiet_pipeline, \
    text_records, tiny_model_fixture

import lorapipe.stages.families as families
from lorapipe.stages.families import ObjectiveParams, TextOptions
from lorapipe.stages.families.latents import PatchedBatchNorm

TEXT_WINDOW = 64  # the pipeline's max_sequence_length in these calls: its left padding


model = tiny_model_fixture("ideogram4")


def _tokens_to_latents(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The pipeline's image tokens as (B, 4C, H/16, W/16), the layout the objective sees."""
    return tokens.unflatten(1, (height // 16, width // 16)).permute(0, 3, 1, 2)


def test_tiny_ideogram4_builds_byte_identically(model, tmp_path):
    assert "unconditional_transformer/config.json" in assert_builds_byte_identically(model, "ideogram4",
                                                                                     tmp_path / "again")
    family = families.for_model(model)
    assert (family.name, family.geometry(model).pixel_multiple, family.variant.train_instead) == ("ideogram4", 16, None)
    assert family.variant.render_steps == 48


def test_text_records_are_what_the_pipeline_encodes(model):
    """Each record is the pipeline's text features at its own tokens (left of them: padding)."""
    from diffusers.pipelines.ideogram4.pipeline_ideogram4 import QWEN3_VL_ACTIVATION_LAYERS

    family, records = text_records(model, CAPTIONS)
    assert family.text_settings(model, TextOptions()).hidden_layers == QWEN3_VL_ACTIVATION_LAYERS
    with torch.no_grad():
        embeds, _, _, indicator = quiet_pipeline(model).encode_prompt(CAPTIONS, grid_h=2, grid_w=2,
                                                                 max_sequence_length=TEXT_WINDOW, device="cpu")
    text = indicator[:, :TEXT_WINDOW] == 3  # LLM_TOKEN_INDICATOR
    assert embeds.shape[2] == 13 * 16
    assert_records_are_the_pipelines_at_their_own_tokens(family, records, embeds[:, :TEXT_WINDOW], text, atol=1e-6)


def test_latent_normalisation_is_the_pipelines(model):
    """Patchified (row, column, channel) and batch-normalised: the inverse of the pipeline's decode."""
    family, pipe = families.for_model(model), quiet_pipeline(model)
    pixels = torch.rand(2, 3, 64, 48, generator=torch.Generator().manual_seed(3)) * 2 - 1
    mean, _ = family.load_latent_encoder(model, "cpu")(pixels)
    normalisation = family.latent_normalisation(model)
    normalised = normalisation.apply(mean)
    assert normalisation.kind == "patch_major_batch_norm" and normalised.shape == (2, 32, 4, 3)
    z = normalised.permute(0, 2, 3, 1).flatten(1, 2)  # as the pipeline's latents, then its decode:
    z = z * torch.sqrt(pipe.vae.bn.running_var + pipe.vae.config.batch_norm_eps) + pipe.vae.bn.running_mean
    z = z.view(2, 4, 3, 2, 2, 8).permute(0, 5, 1, 3, 2, 4).reshape(2, 8, 8, 6)
    assert torch.allclose(z, mean, atol=1e-5)
    flux2_order = PatchedBatchNorm(**normalisation.model_dump(exclude={"kind"})).apply(mean)
    assert not torch.allclose(normalised, flux2_order, atol=1e-3)  # Flux.2's (channel, row, column) differs


def test_denoiser_call_is_the_pipelines(model):
    """The pipeline left-pads its text to max_sequence_length, the family to the batch's longest:
    the segment ids keep the padding apart, so the prediction agrees to rounding; the family's is
    the objective's velocity, the negative of the transformer's."""
    family, pipe = families.for_model(model), quiet_pipeline(model)
    _, kwargs, output = first_call(pipe.transformer, lambda: pipe(
        CAPTIONS[:2], num_inference_steps=2, height=64, width=48, guidance_scale=3.0, guidance_schedule=None,
        max_sequence_length=TEXT_WINDOW, generator=torch.Generator().manual_seed(0), output_type="latent"))
    cond = family.conditioning(text_records(model, CAPTIONS[:2])[1], [], ObjectiveParams())
    noisy = _tokens_to_latents(kwargs["hidden_states"][:, TEXT_WINDOW:], 64, 48)
    sigma = pipe.scheduler.sigmas[0]
    assert torch.allclose(kwargs["timestep"], 1 - sigma.expand(2))
    with torch.no_grad():
        predicted = family.predict(pipe.transformer, noisy, sigma.expand(2), cond, torch.float32)
    assert noisy.shape == (2, 32, 4, 3)
    assert torch.allclose(predicted, -_tokens_to_latents(output[0][:, TEXT_WINDOW:], 64, 48), atol=1e-5)


def _stop_after_the_first_step(pipe, step, timestep, tensors):
    pipe._interrupt = True  # the pipeline skips the remaining steps: its schedule is what is read
    return tensors


@pytest.mark.parametrize("height, width", [(256, 192), (1024, 768)])
def test_training_draws_noise_levels_as_the_pipeline_samples_them(model, height, width):
    """`shift: model` draws the sigmas Ideogram4Pipeline's schedule samples: logit-normal about its
    resolution-aware mean. The pipeline's N sigmas are its distribution's quantiles (N - k) / N,
    so the drawn sigmas fall below each in that fraction, and their logits' mean and standard
    deviation are the schedule's."""
    family, pipe = families.for_model(model), quiet_pipeline(model)
    steps, draws = 1000, 200_000
    pipe(CAPTIONS[1], num_inference_steps=steps, height=height, width=width, guidance_scale=3.0, guidance_schedule=None,
         max_sequence_length=TEXT_WINDOW, output_type="latent", callback_on_step_end=_stop_after_the_first_step)
    scheduled = pipe.scheduler.sigmas[:-1]  # decreasing; the first is the clamped end
    objective = family.objective(model, ObjectiveParams())
    drawn = objective.sample_timesteps((draws, 32, height // 16, width // 16), torch.Generator().manual_seed(0))
    below = torch.searchsorted(drawn.sort().values, scheduled) / draws
    assert (below - (1 - torch.arange(steps) / steps)).abs().max() < 0.01
    logit, expected = torch.logit(drawn.double()), torch.logit(scheduled[1:].double())
    assert logit.mean().item() == pytest.approx(expected.mean().item(), abs=0.02)
    assert logit.std().item() == pytest.approx(expected.std().item(), abs=0.02)
    assert expected.mean().item() == pytest.approx(0.5 * math.log(height * width / 512 ** 2), abs=1e-3)


def test_original_export_is_in_ideogram_names_and_loads_in_diffusers(model, exported_loras):
    """`diffusion_model.layers.N.attention.qkv` (q|k|v fused), `attention.o`, the scale in lora_B:
    read by Ideogram4Pipeline's own non-diffusers converter; every Linear of the blocks adapted (the
    names Ideogram's files have)."""
    transformer, targets, written = exported_loras("ideogram4")
    keys = keys_of(written[1])
    assert {"diffusion_model.layers.0.attention.qkv.lora_A.weight",
            "diffusion_model.layers.1.attention.o.lora_B.weight",
            "diffusion_model.layers.1.feed_forward.w3.lora_A.weight",
            "diffusion_model.layers.0.adaln_modulation.lora_B.weight"} <= keys
    assert len(keys) == 2 * (len(targets) - 2 * 2) and not any(k.endswith(".alpha") for k in keys)
    assert_means_what_was_trained(transformer, targets, fused_change(quiet_pipeline(model), "transformer", written[1]))
