"""The Chroma family against ChromaPipeline on the tiny offline Chroma: the cached text record (T5
encoded with the tokenizer's mask, every position kept, the mask the transformer reads) is what
inference encodes, the latents are Flux.1's normalisation as the pipeline's VAE makes them, and the
denoiser call, its additive text mask included, is the pipeline's; the LoRA files in Chroma's original
names load through diffusers' converter and ComfyUI's key map."""
from __future__ import annotations

import pytest
import torch
from comfyui_keys import assert_comfyui_applies_the_merged_model, comfyui_unread
from family_checks import (CAPTIONS, assert_builds_byte_identically, assert_loads_key_for_key, assert_means_what_was_trained,
                           assert_resolution_shift_is_the_pipelines, first_step_predicted, fused_change, keys_of,
                           quiet_pipeline, text_records, tiny_model_fixture, trained_lora)

import lorapipe.stages.families as families
from lorapipe.stages.families import ObjectiveParams, TextOptions
from lorapipe.stages.train.checkpointing import enable_gradient_checkpointing

chroma = tiny_model_fixture("chroma")


def test_tiny_chroma_builds_byte_identically_as_one_variant(chroma, tmp_path):
    assert "tokenizer/tokenizer.json" in assert_builds_byte_identically(chroma, "chroma", tmp_path / "again")
    family = families.for_model(chroma)
    assert (family.name, family.bound.name, family.bound.render_steps, family.bound.render_guidance) == (
        "chroma", "chroma1", 35, 5.0)
    assert family.geometry(chroma).pixel_multiple == 16
    with pytest.raises(ValueError, match="train.guidance: Chroma chroma1 has no guidance input"):
        family.check_objective(ObjectiveParams(guidance=3.5))


def test_text_records_are_what_the_pipeline_encodes(chroma):
    """Every position, padding included (the transformer reads it), and the pipeline's mask: the
    caption's tokens and the first padding token."""
    family, records = text_records(chroma, CAPTIONS, TextOptions(max_sequence_length=16))
    with torch.no_grad():
        embeds, _, mask, *_ = quiet_pipeline(chroma).encode_prompt(CAPTIONS, max_sequence_length=16,
                                                                   do_classifier_free_guidance=False)
    assert embeds.shape == (3, 16, 32) and mask.sum(1).tolist() == [16, 7, 2]  # truncated: every token read
    for record, embed, read in zip(records, embeds, mask, strict=True):
        assert torch.equal(record["hidden_states"], embed) and torch.equal(record["attention_mask"], read)
    settings = family.text_settings(chroma, TextOptions(max_sequence_length=16))
    assert family.render_kwargs(settings, 5.0, "blurry") == {"guidance_scale": 5.0, "negative_prompt": "blurry",
                                                             "max_sequence_length": 16}
    with pytest.raises(ValueError, match="encode.max_sequence_length: Chroma reads at most 512"):
        family.text_settings(chroma, TextOptions(max_sequence_length=1024))


def test_latent_normalisation_is_the_pipelines(chroma):
    from diffusers import ChromaImg2ImgPipeline

    family, pipe = families.for_model(chroma), quiet_pipeline(chroma)
    pixels = torch.rand(2, 3, 64, 48, generator=torch.Generator().manual_seed(3)) * 2 - 1
    mean, std = family.load_latent_encoder(chroma, "cpu")(pixels)  # what a latent record holds
    sample = mean + std * torch.randn(mean.shape, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():  # the image-to-image pipeline's VAE encode: a posterior sample
        expected = ChromaImg2ImgPipeline._encode_vae_image(pipe, pixels, torch.Generator().manual_seed(5))
    normalise = family.latent_normalisation(chroma)
    assert (normalise.scale, normalise.shift) == (0.3611, 0.1159)
    assert expected.shape == (2, 16, 8, 6)
    assert torch.allclose(normalise.apply(sample), expected, atol=1e-6)


def test_denoiser_call_is_the_pipelines_mask_included(chroma):
    """The pipeline's first transformer call (the positive prompts, under real CFG) is predict's on
    the cached records: captions of three lengths, each with its own mask."""
    def unpack(pipe, kwargs):
        return pipe._unpack_latents(kwargs["hidden_states"], 64, 48, pipe.vae_scale_factor)

    noisy, predicted, output, kwargs, pipe = first_step_predicted(
        chroma, CAPTIONS, unpack, TextOptions(max_sequence_length=16), height=64, width=48, guidance_scale=5.0,
        negative_prompt="blurry", max_sequence_length=16)
    assert noisy.shape == (3, 16, 8, 6) and kwargs["attention_mask"].shape == (3, 16 + 12)
    assert torch.equal(predicted, unpack(pipe, {"hidden_states": output[0]}))


def test_shift_is_the_pipelines_by_resolution(chroma):
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    assert_resolution_shift_is_the_pipelines(chroma, calculate_shift, 256, 4096, 0.5, 1.15)


def test_every_exported_file_loads_as_written(chroma, exported_loras):
    """The diffusers file lands key for key on ChromaPipeline's LoRA weights; ComfyUI (whose Chroma is
    a Flux model: Chroma's original names and Flux.1's diffusers names) applies the trained model from
    the kohya and ComfyUI files and reads every key of the diffusers one."""
    transformer, _, written = exported_loras("chroma")
    family, pipe = families.for_model(chroma), quiet_pipeline(chroma)
    assert_loads_key_for_key(pipe, written[0])
    for file in written[1:]:
        assert_comfyui_applies_the_merged_model(file, transformer, family)
    assert not comfyui_unread(written[0], transformer, family)


@pytest.mark.parametrize("file", [1, 2], ids=["kohya", "comfyui"])
def test_original_name_exports_load_through_diffusers_converter(chroma, tmp_path, file):
    """Chroma's names (q/k/v fused into img_attn.qkv and txt_attn.qkv), spelt as kohya and as ComfyUI,
    loaded by ChromaPipeline's (Flux.1's) kohya converter: every key maps and the fused change is the
    trained one. Double blocks only: diffusers 0.42.1 splits linear1 at Flux.1's fixed widths."""
    family = families.for_model(chroma)
    double = tuple(t for t in family.lora_target_modules(family.load_denoiser(chroma, torch.float32), "all_linear")
                   if t.startswith("transformer_blocks."))
    transformer, targets = trained_lora(family, chroma, double)
    exported = family.export_lora(transformer, tmp_path, {"lorapipe.steps": "1"}, {"ss_network_alpha": "3.0"})[file]
    assert next(iter(keys_of(exported))).startswith(("lora_unet_double_blocks_0_", "diffusion_model.double_blocks.0."))
    assert_means_what_was_trained(transformer, targets, fused_change(quiet_pipeline(chroma), "transformer", exported))


def test_gradient_checkpointing_trains_what_the_pipeline_calls(chroma):
    """diffusers 0.42.1 leaves the mask out of the single blocks when checkpointing: the family's
    denoiser predicts, and its LoRA gets the gradients, as without checkpointing."""
    family = families.for_model(chroma)
    _, records = text_records(chroma, CAPTIONS, TextOptions(max_sequence_length=16))
    cond = family.conditioning(records, [], ObjectiveParams())
    noisy = torch.randn(3, 16, 8, 6, generator=torch.Generator().manual_seed(0))
    outputs = []
    for checkpointed in (False, True):
        torch.manual_seed(0)  # the same LoRA both times
        denoiser, _ = trained_lora(family, chroma, "all_linear")
        if checkpointed:
            enable_gradient_checkpointing(denoiser)
        predicted = family.predict(denoiser.train(), noisy, torch.tensor([0.3, 0.6, 0.9]), cond, torch.float32)
        predicted.square().mean().backward()
        grads = [p.grad for n, p in sorted(denoiser.named_parameters()) if "lora_" in n]
        outputs.append((predicted.detach(), grads))
    (plain, plain_grads), (checkpointed, checkpointed_grads) = outputs
    assert torch.allclose(checkpointed, plain, atol=1e-6)
    assert all(torch.allclose(c, p, atol=1e-6) for c, p in zip(checkpointed_grads, plain_grads, strict=True))
