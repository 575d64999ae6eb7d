"""The Qwen-Image family against QwenImagePipeline on the tiny offline Qwen-Image: the cached text
record (the caption's tokens after the system template's 34, unpadded) padded per batch by the
family is what inference encodes, the one-frame latents' per-channel normalisation and the denoiser
call are the pipeline's, the shift comes from the scheduler config, and both LoRA exports load
through QwenImagePipeline's own loader and mean what was trained."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from comfyui_keys import assert_comfyui_applies_the_merged_model, comfyui_unread
from family_checks import assert_builds_byte_identically, assert_means_what_was_trained, \
    assert_shift_is_the_schedulers, first_call, fused_change, trained_lora, quiet_pipeline
from safetensors import safe_open

import lorapipe.stages.families as families
from lorapipe.stages.families import ObjectiveParams, TextOptions

CAPTIONS = ["a photo of a tabby cat looking to the side", "a rocket", ""]


@pytest.fixture(scope="module")
def model(tiny_models) -> Path:
    return tiny_models("qwen-image")



def test_tiny_qwen_image_builds_byte_identically_and_loads(model, tmp_path):
    assert "text_encoder/config.json" in assert_builds_byte_identically(model, "qwen-image", tmp_path / "again")
    family = families.for_model(model)
    assert (family.name, family.pixel_multiple(model), family.train_instead()) == ("qwen-image", 16, None)
    with pytest.raises(ValueError, match="encode.max_sequence_length: Qwen-Image reads at most 1024"):
        family.text_settings(model, TextOptions(max_sequence_length=2048))


@pytest.mark.parametrize("captions", [CAPTIONS, CAPTIONS[:1]])
def test_text_records_are_what_the_pipeline_encodes(model, captions):
    """Unpadded records; padded per batch they are the pipeline's embeddings and mask, and the mask is
    left out, as the pipeline leaves it out, when nothing in the batch is padded."""
    family = families.for_model(model)
    settings = family.text_settings(model, TextOptions())
    records = family.load_text_encoder(model, settings, torch.float32, "cpu")(captions)
    with torch.no_grad():
        embeds, mask = quiet_pipeline(model).encode_prompt(list(captions), max_sequence_length=512)
    cond = family.conditioning(records, [], ObjectiveParams())
    assert torch.equal(cond["encoder_hidden_states"], embeds)
    if mask is None:
        assert "encoder_hidden_states_mask" not in cond and len(captions) == 1
    else:
        assert torch.equal(cond["encoder_hidden_states_mask"], mask.bool())
        assert [r["hidden_states"].shape[0] for r in records] == mask.sum(1).tolist()


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


def test_denoiser_call_is_the_pipelines(model):
    family, pipe = families.for_model(model), quiet_pipeline(model)
    _, kwargs, output = first_call(pipe.transformer, lambda: pipe(
        CAPTIONS[:2], num_inference_steps=2, height=64, width=48, true_cfg_scale=1.0,
        generator=torch.Generator().manual_seed(0), output_type="latent"))
    records = family.load_text_encoder(model, family.text_settings(model, TextOptions()), torch.float32,
                                       "cpu")(CAPTIONS[:2])
    cond = family.conditioning(records, [], ObjectiveParams())
    noisy = pipe._unpack_latents(kwargs["hidden_states"], 64, 48, pipe.vae_scale_factor).squeeze(2)
    with torch.no_grad():
        predicted = family.predict(pipe.transformer, noisy, pipe.scheduler.sigmas[0].expand(2), cond, torch.float32)
    assert noisy.shape == (2, 4, 8, 6)
    assert torch.equal(predicted, pipe._unpack_latents(output[0], 64, 48, pipe.vae_scale_factor).squeeze(2))


def test_shift_is_the_schedulers(model):
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    objective = assert_shift_is_the_schedulers(model, lambda tokens: calculate_shift(tokens, 256, 4096, 0.5, 0.9))
    assert (objective.sampling.shift, objective.sampling.max_shift) == ("resolution", 0.9)


def test_lora_presets(model):
    family = families.for_model(model)
    transformer = family.load_denoiser(model, torch.float32)
    attention = family.lora_target_modules(transformer, "attention")
    assert len(attention) == 16 and "transformer_blocks.1.attn.to_add_out" in attention
    with_ff = family.lora_target_modules(transformer, "attention_ff")
    assert set(with_ff) - set(attention) == {f"transformer_blocks.{i}.{m}.net.{p}" for i in range(2)
                                             for m in ("img_mlp", "txt_mlp") for p in ("0.proj", "2")}
    assert set(family.lora_target_modules(transformer, "all_linear")) - set(with_ff) == {
        f"transformer_blocks.{i}.{m}.1" for i in range(2) for m in ("img_mod", "txt_mod")}


@pytest.fixture(scope="module")
def exported(model, tmp_path_factory):
    family = families.for_model(model)
    transformer, targets = trained_lora(family, model, "all_linear")
    return transformer, targets, family.export_lora(transformer, tmp_path_factory.mktemp("exports"), {}, {})


def test_diffusers_export_loads_and_means_what_was_trained(model, exported):
    transformer, targets, written = exported
    assert [p.name for p in written] == ["pytorch_lora_weights.safetensors", "pytorch_lora_weights_comfyui.safetensors"]
    assert_means_what_was_trained(transformer, targets, fused_change(quiet_pipeline(model), "transformer", written[0]))


def test_comfyui_export_loads_in_diffusers_and_comfyui(model, exported):
    """`diffusion_model.<name>.lora_A/lora_B.weight`, the scale in lora_B and no `.alpha`: read by
    QwenImagePipeline's own non-diffusers converter as it is, and by ComfyUI; both apply the trained
    model. ComfyUI also reads every key of the diffusers file (its Qwen-Image key map takes
    `transformer.<name>`), but with no adapter config, at scale 1 instead of alpha / rank."""
    transformer, targets, written = exported
    with safe_open(written[1], "pt") as f:
        keys = set(f.keys())
    assert "diffusion_model.transformer_blocks.0.attn.to_q.lora_A.weight" in keys
    assert not any(k.endswith(".alpha") for k in keys)
    assert_means_what_was_trained(transformer, targets, fused_change(quiet_pipeline(model), "transformer", written[1]))
    assert_comfyui_applies_the_merged_model(written[1], transformer, families.for_model(model))
    assert not comfyui_unread(written[0], transformer, families.for_model(model))
