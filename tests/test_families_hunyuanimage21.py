"""The HunyuanImage 2.1 family against HunyuanImagePipeline on the tiny offline model: the cached text
records (Qwen2.5-VL's and, for quoted text, ByT5's, each at its own tokens) are what encode_prompt
makes, the latents' normalisation is what the pipeline inverts before decoding, and the denoiser
call is the pipeline's first."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from family_checks import assert_builds_byte_identically, assert_only_the_guiders_scale_renders, \
    assert_text_and_glyph_records_are_encode_prompts, first_call, quiet_pipeline, text_records, tiny_model_fixture

import lorapipe.stages.families as families
from lorapipe.cache.errors import UserError
from lorapipe.stages.families import ObjectiveParams

CAPTIONS = ["a sign that says 'hello' on a wall", "a rocket", ""]  # the first quotes text (single quotes: read too)

model = tiny_model_fixture("hunyuanimage2.1")


def test_tiny_hunyuanimage21_builds_byte_identically_and_is_told_apart(model, tmp_path):
    files = assert_builds_byte_identically(model, "hunyuanimage2.1", tmp_path / "again")
    assert {"text_encoder_2/model.safetensors", "tokenizer_2/tokenizer_config.json",
            "guider/guider_config.json"} <= set(files)
    family = families.for_model(model)
    assert (family.name, family.variant.tiny_arch, family.video) == ("hunyuanimage2.1", "hunyuanimage2.1", False)
    assert (family.geometry(model).pixel_multiple, family.sampler) == (32, "flow_match_euler")


def test_text_records_are_encode_prompts_at_their_own_tokens(model):
    assert_text_and_glyph_records_are_encode_prompts(model, CAPTIONS)


def test_latents_and_their_normalisation_are_the_pipelines(model):
    """Images through the family's encoder are the VAE's posterior at 32x (C, H/32, W/32); normalised, it is what the pipeline turns back into the VAE's latents before decoding
    (the decoder's first input, after one step at sigma 0, which leaves the latents as they are)."""
    pipe, family = quiet_pipeline(model), families.for_model(model)
    encoder = family.load_latent_encoder(model, "cpu")
    images = torch.rand(2, 3, 64, 96, generator=torch.Generator().manual_seed(3)) * 2 - 1
    mean, std = encoder(images)
    assert mean.shape == std.shape == (2, 4, 2, 3)
    with torch.no_grad():
        assert torch.equal(mean, pipe.vae.encode(images).latent_dist.mode())
    normalised = family.latent_normalisation(model).apply(mean[:1])
    args, _, _ = first_call(pipe.vae.decoder.conv_in, lambda: pipe(
        "a cat", latents=normalised, sigmas=[0.0], num_inference_steps=1, height=64, width=96, output_type="pt"))
    assert torch.allclose(args[0], mean[:1], atol=1e-6)


@pytest.mark.parametrize("captions", [CAPTIONS[:2], CAPTIONS[1:2]])
def test_denoiser_call_is_the_pipelines(model, captions):
    """family.predict on the pipeline's first noisy latents, the cached records padded per batch and
    sigma = t / 1000 is the pipeline's first (conditional) transformer call: the same timestep and
    prediction, though the pipeline pads its texts to their full lengths."""
    family, pipe = families.for_model(model), quiet_pipeline(model)
    _, kwargs, output = first_call(pipe.transformer, lambda: pipe(
        captions, num_inference_steps=2, height=64, width=64, generator=torch.Generator().manual_seed(0),
        output_type="latent"))
    cond = family.conditioning(text_records(model, captions)[1], [], ObjectiveParams())
    predicted = []
    with torch.no_grad():
        _, ours, _ = first_call(pipe.transformer, lambda: predicted.append(
            family.predict(pipe.transformer, kwargs["hidden_states"], kwargs["timestep"] / 1000, cond, torch.float32)))
    assert torch.allclose(ours["timestep"], kwargs["timestep"])
    assert torch.allclose(predicted[0], output[0], atol=1e-5)


def test_a_guidance_scale_other_than_the_guiders_is_refused(model):
    assert_only_the_guiders_scale_renders(model, 3.5)


def test_the_distilled_checkpoint_is_refused_naming_the_base(model, tmp_path):
    """The distilled model's meanflow transformer reads the sampler's next timestep too: refused in one
    line naming its config and the base to train instead, not trained as the base."""
    shutil.copy(model / "model_index.json", tmp_path)
    (tmp_path / "transformer").mkdir()
    config = json.loads((model / "transformer" / "config.json").read_text())
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({**config, "use_meanflow": True,
                                                                      "guidance_embeds": True}))
    with pytest.raises(UserError, match=r"transformer/config.json: the distilled HunyuanImage 2.1 \(use_meanflow\).*"
                                        r"train the base \(hunyuanvideo-community/HunyuanImage-2.1-Diffusers\)"):
        families.for_model(tmp_path)


def test_comfyui_export_is_comfyuis_model_names_and_applies_the_trained_model(model, exported_loras):
    """The blocks in ComfyUI's HunyuanImage 2.1 model's own names under `diffusion_model.` (its key
    map has no table of its own): q|k|v fused in `img_attn.qkv`, q|k|v|mlp in a single block's
    `linear1`, the scale in lora_B and no `.alpha`; ComfyUI's key map reads every key and applies the
    trained model."""
    from comfyui_keys import assert_comfyui_applies_the_merged_model
    from family_checks import keys_of

    transformer, _, written = exported_loras("hunyuanimage2.1")
    keys = keys_of(written[1])
    assert {"diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight",
            "diffusion_model.double_blocks.1.txt_mlp.2.lora_B.weight",
            "diffusion_model.single_blocks.1.linear1.lora_B.weight",
            "diffusion_model.single_blocks.0.modulation.lin.lora_A.weight"} <= keys
    assert not any(key.endswith(".alpha") for key in keys)
    assert_comfyui_applies_the_merged_model(written[1], transformer, families.for_model(model))
