"""The Flux.1 Kontext family against FluxKontextPipeline on the tiny offline Kontext (the tiny
Flux.1 dev's weights): with a reference image, family.predict on the unpacked noisy latent, the
reference's normalised posterior mean and the cached text record is the pipeline's own transformer
call; without one it is the text-to-image call; the render arguments keep the output and the
reference at the target's size; and the LoRA files Flux.1 exports load through the Kontext
pipeline and mean what was trained."""
from __future__ import annotations

from pathlib import Path

import torch
from family_checks import (assert_builds_byte_identically, assert_means_what_was_trained, first_call, fused_change,
                           quiet_pipeline, tiny_model_fixture, trained_lora)
from PIL import Image

import lorapipe.stages.families as families
from lorapipe.stages.evaluate.render import render_size_kwargs
from lorapipe.stages.families import ObjectiveParams, TextOptions
from lorapipe.stages.demo.photos import DEMO_PHOTOS
from lorapipe.stages.families.base import REFERENCE_LATENTS

INSTRUCTION = "add a red hat"
HEIGHT, WIDTH = 64, 48  # the target's size; the reference is placed at it, as training places it


kontext = tiny_model_fixture("flux1-kontext")


def test_tiny_kontext_builds_byte_identically_with_flux1_devs_transformer(kontext, flux_model, tmp_path):
    assert "transformer/diffusion_pytorch_model.safetensors" in assert_builds_byte_identically(
        kontext, "flux1-kontext", tmp_path / "again")
    weights = "transformer/diffusion_pytorch_model.safetensors"
    assert (kontext / weights).read_bytes() == (flux_model / weights).read_bytes()
    family = families.for_model(kontext)
    assert (family.name, family.bound.name, family.max_references, family.variant.tiny_arch) == (
        "flux1-kontext", "dev", 1, "flux1-kontext")
    assert type(quiet_pipeline(kontext)).__name__ == "FluxKontextPipeline"
    assert (family.variant.render_steps, family.variant.render_guidance, family.sampler) == \
        (28, 2.5, "flow_match_euler")


def reference_photo() -> Image.Image:
    with Image.open(DEMO_PHOTOS / "astronaut.jpg") as photo:
        return photo.convert("RGB").resize((WIDTH, HEIGHT))


def pipeline_call(model: Path, **kwargs) -> tuple[dict, torch.Tensor, object]:
    """The transformer's kwargs and output in the pipeline's first step, and the pipeline."""
    family, pipe = families.for_model(model), quiet_pipeline(model)
    _, seen, output = first_call(pipe.transformer, lambda: pipe(
        prompt=INSTRUCTION, num_inference_steps=2, height=HEIGHT, width=WIDTH, guidance_scale=2.5, max_sequence_length=64,
        generator=torch.Generator().manual_seed(0), output_type="latent", **render_size_kwargs(family, HEIGHT, WIDTH),
        **kwargs))
    return seen, output[0], pipe


def conditioning(model: Path) -> dict[str, torch.Tensor]:
    family = families.for_model(model)
    settings = family.text_settings(model, TextOptions(max_sequence_length=64))
    record = family.text_encoder(model, settings, torch.float32, "cpu")([INSTRUCTION])
    return family.conditioning(record, [], ObjectiveParams(guidance=2.5))


def test_denoiser_call_with_a_reference_is_the_pipelines(kontext):
    """The reference latent as encode caches it (the VAE's posterior mean, normalised) and the
    noisy latent, through family.predict: the pipeline's transformer output for the target's tokens,
    the reference's tokens following them with ids (1, row, col)."""
    family = families.for_model(kontext)
    reference = reference_photo()
    seen, output, pipe = pipeline_call(kontext, **family.reference_render_kwargs([reference]))
    tokens = (HEIGHT // 16) * (WIDTH // 16)
    assert seen["hidden_states"].shape[1] == 2 * tokens  # the reference kept at the target's size
    assert torch.equal(seen["img_ids"][tokens:, 0], torch.ones(tokens))
    assert torch.equal(seen["img_ids"][tokens:, 1:], seen["img_ids"][:tokens, 1:])
    mean, _ = family.load_latent_encoder(kontext, "cpu")(pipe.image_processor.preprocess(reference, HEIGHT, WIDTH))
    references = family.latent_normalisation(kontext).apply(mean)
    latent_side = (HEIGHT // 8, WIDTH // 8)
    assert torch.allclose(pipe._pack_latents(references, 1, 16, *latent_side), seen["hidden_states"][:, tokens:],
                          atol=1e-6)
    noisy = pipe._unpack_latents(seen["hidden_states"][:, :tokens], HEIGHT, WIDTH, pipe.vae_scale_factor)
    cond = {**conditioning(kontext), REFERENCE_LATENTS: references.unsqueeze(1)}
    with torch.no_grad():
        predicted = family.predict(pipe.transformer, noisy, seen["timestep"], cond, torch.float32)
    expected = pipe._unpack_latents(output[:, :tokens], HEIGHT, WIDTH, pipe.vae_scale_factor)
    assert predicted.shape == (1, 16, *latent_side)
    assert torch.allclose(predicted, expected, atol=1e-5)


def test_denoiser_call_without_a_reference_is_text_to_image(kontext):
    family = families.for_model(kontext)
    seen, output, pipe = pipeline_call(kontext)
    noisy = pipe._unpack_latents(seen["hidden_states"], HEIGHT, WIDTH, pipe.vae_scale_factor)
    assert noisy.shape == (1, 16, HEIGHT // 8, WIDTH // 8)  # max_area: not rescaled to the pipeline's default area
    with torch.no_grad():
        predicted = family.predict(pipe.transformer, noisy, seen["timestep"], conditioning(kontext), torch.float32)
    assert torch.equal(predicted, pipe._unpack_latents(output, HEIGHT, WIDTH, pipe.vae_scale_factor))


def test_lora_files_load_through_the_kontext_pipeline(kontext, tmp_path):
    """Flux.1's three files (Kontext's transformer is Flux.1's): each loaded by
    FluxKontextPipeline.load_lora_weights into a fresh pipeline and fused changes every trained
    weight by its B @ A x scale and no other. Double blocks only: diffusers' kohya/ComfyUI Flux
    converter splits the single blocks' linear1 at Flux.1's full widths (tests/test_families_flux1.py)."""
    family = families.for_model(kontext)
    double = tuple(t for t in family.lora_target_modules(family.load_denoiser(kontext, torch.float32), "all_linear")
                   if t.startswith("transformer_blocks."))
    transformer, targets = trained_lora(family, kontext, double)
    written = family.export_lora(transformer, tmp_path, {"lorapipe.steps": "1"}, {"ss_network_alpha": "3.0"})
    assert [p.name for p in written] == ["pytorch_lora_weights.safetensors", "pytorch_lora_weights_kohya.safetensors",
                                         "pytorch_lora_weights_comfyui.safetensors"]
    for file in written:
        assert_means_what_was_trained(transformer, targets, fused_change(quiet_pipeline(kontext), "transformer", file))
