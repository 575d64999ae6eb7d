"""The Qwen-Image 2.1 family against QwenImage21Pipeline on the tiny offline Qwen-Image 2.1: the
cached text record (the caption's tokens after the system message's, unpadded, before the encoder's
final norm) padded per batch by the family is what inference encodes, the one-frame latents'
per-channel normalisation and the joint-sequence denoiser call are the pipeline's, and the LoRA
exports load through the pipeline's own loader (and ComfyUI's key map) and mean what was trained.

The tiny model's processor is a LlavaProcessor around Qwen's tokenizer, not a Qwen3VLProcessor:
transformers cannot build any processor with a video processor without torchvision, which has no
build here; the family reads only the processor's tokenizer, which both hold."""
from __future__ import annotations


import pytest
import torch
from comfyui_keys import assert_comfyui_applies_the_merged_model, comfyui_unread
from family_checks import CAPTIONS, assert_builds_byte_identically, assert_means_what_was_trained, \
    assert_padded_per_batch_as_the_pipeline, assert_resolution_shift_is_the_pipelines, first_step_predicted, \
    fused_change, keys_of, quiet_pipeline, text_records, tiny_model_fixture, trained_lora

import lorapipe.stages.families as families
from lorapipe.stages.families import TextOptions


model = tiny_model_fixture("qwen-image-2.1")


def test_tiny_qwen_image_21_builds_byte_identically_and_loads(model, tmp_path):
    assert "processor/tokenizer.json" in assert_builds_byte_identically(model, "qwen-image-2.1", tmp_path / "again")
    family = families.for_model(model)
    assert (family.name, family.geometry(model).pixel_multiple, family.variant.train_instead) == \
        ("qwen-image-2.1", 32, None)
    assert family.text_settings(model, TextOptions()).drop_tokens == quiet_pipeline(model)._drop_idx


@pytest.mark.parametrize("captions", [CAPTIONS, CAPTIONS[:1]])
def test_text_records_are_what_the_pipeline_encodes(model, captions):
    """Unpadded records; padded per batch they are the pipeline's embeddings and mask, and the mask is
    left out, as the pipeline leaves it out, when nothing in the batch is padded."""
    family, records = text_records(model, captions)
    with torch.no_grad():
        embeds, mask, _ = quiet_pipeline(model).encode_prompt(list(captions), device="cpu")
    assert_padded_per_batch_as_the_pipeline(family, records, embeds, mask)


def test_latent_normalisation_is_the_pipelines(model):
    """The VAE's one frame, squeezed into (C, H, W) records, normalised per channel as the pipeline
    normalises a condition image's latents on (B, C, 1, H, W)."""
    family, pipe = families.for_model(model), quiet_pipeline(model)
    pixels = torch.rand(2, 3, 64, 96, generator=torch.Generator().manual_seed(3)) * 2 - 1
    mean, std = family.load_latent_encoder(model, "cpu")(pixels)
    assert mean.shape == std.shape == (2, 4, 4, 6)
    with torch.no_grad():
        expected = pipe._encode_vae_image(pixels.unsqueeze(2), None)  # the posterior's mode, as the pipeline takes
    assert torch.allclose(family.latent_normalisation(model).apply(mean), expected.squeeze(2), atol=1e-6)


def test_denoiser_call_is_the_pipelines(model):
    """The transformer returns the joint sequence: the image's 24 tokens are its last."""
    def unpacked(pipe, tokens: torch.Tensor) -> torch.Tensor:
        return pipe._unpack_latents(tokens, 64, 96, pipe.vae_scale_factor).squeeze(2)

    noisy, predicted, output, _, pipe = first_step_predicted(
        model, CAPTIONS[:2], lambda pipe, kwargs: unpacked(pipe, kwargs["hidden_states"]), height=64, width=96,
        true_cfg_scale=1.0)
    assert noisy.shape == (2, 4, 4, 6)
    assert torch.equal(predicted, unpacked(pipe, output[0][:, -24:]))


def test_shift_is_the_schedulers(model):
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_shift

    assert_resolution_shift_is_the_pipelines(model, calculate_shift, 256, 4096, 0.5, 0.9)


def test_comfyui_export_fuses_gate_and_up_as_the_original_checkpoint(model, exported_loras):
    """`diffusion_model.<name>`, the MLP's gate and up one `gate_up` LoRA (downs stacked, ups
    block-diagonal, gate rows first): ComfyUI's model applies the trained model from it and reads
    every key."""
    transformer, _, written = exported_loras("qwen-image-2.1")
    keys = keys_of(written[1])
    assert "diffusion_model.transformer_blocks.0.img_mlp.gate_up.lora_A.weight" in keys
    assert not any(".gate_layer." in k or ".img_mlp.proj." in k for k in keys)
    family = families.for_model(model)
    assert_comfyui_applies_the_merged_model(written[1], transformer, family)
    assert not comfyui_unread(written[1], transformer, family)


def test_comfyui_attention_export_loads_in_diffusers(model, tmp_path):
    """Without the fused MLP, the ComfyUI file is read by the pipeline's own non-diffusers converter
    as it is, and means what was trained."""
    family = families.for_model(model)
    transformer, targets = trained_lora(family, model, "attention")
    comfyui = family.export_lora(transformer, tmp_path, {}, {})[1]
    assert_means_what_was_trained(transformer, targets, fused_change(quiet_pipeline(model), "transformer", comfyui))
