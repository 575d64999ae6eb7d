"""The Kandinsky 5 text-to-video family against Kandinsky5T2VPipeline on the tiny offline model: the
text records (the video template) are what encode_prompt makes, the latents are the 3-D VAE's
posterior scaled as the pipeline unscales them, and the denoiser call (a visual condition of zeros,
the rope scaled by the size) is the pipeline's first."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from family_checks import (CAPTIONS, assert_builds_byte_identically, encoded_clip, first_call, quiet_pipeline,
                           text_records, tiny_model_fixture)
from test_families_kandinsky5 import assert_records_are_encode_prompts

import lorapipe.stages.families as families
from lorapipe.cache.errors import UserError
from lorapipe.stages.families import ObjectiveParams, TextOptions

model = tiny_model_fixture("kandinsky5-video")


def test_tiny_kandinsky5_video_builds_byte_identically_and_is_told_apart(model, tmp_path):
    assert_builds_byte_identically(model, "kandinsky5-video", tmp_path / "again")
    family = families.for_model(model)
    assert (family.name, family.bound.name, family.video, family.temporal_compression(model)) == (
        "kandinsky5-video", "5.0-t2v-lite", True, 4)
    assert family.geometry(model).pixel_multiple == 16 and family.clip_kwargs(model, None, 24) == {"num_frames": 121}
    assert family.frames_problem(model, 6) == "Kandinsky 5 video takes windows of 4k+1 frames (1, 5, 9, ...), not 6"


def test_text_records_are_encode_prompts_in_the_video_template(model):
    family, _, _, _ = assert_records_are_encode_prompts(model, CAPTIONS)
    assert family.text_settings(model, TextOptions()).template_tokens == 128


def test_latents_are_the_posterior_scaled_as_the_pipeline_unscales_them(model):
    """A 5-frame clip is the 3-D VAE's posterior (16, 2, H/8, W/8); the pipeline divides by
    scaling_factor before decoding, and so the family multiplies by it (the VAE has no shift)."""
    pipe = quiet_pipeline(model)
    family, _, _, mean = encoded_clip(model, pipe, 5, 32, 48)
    assert mean.shape == (1, 16, 2, 4, 6)
    assert torch.equal(family.latent_normalisation(model).apply(mean), mean * pipe.vae.config.scaling_factor)


def test_denoiser_call_is_the_pipelines_with_its_visual_condition_and_rope_scale(model):
    """The pipeline steps the noisy channels of its latents in place: they are taken as the
    transformer receives them."""
    family, pipe = families.for_model(model), quiet_pipeline(model)
    received = []
    handle = pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: received.append(kwargs["hidden_states"].clone()), with_kwargs=True)
    _, kwargs, output = first_call(pipe.transformer, lambda: pipe(
        CAPTIONS[0], num_inference_steps=2, height=32, width=48, num_frames=5, guidance_scale=1.0,
        generator=torch.Generator().manual_seed(0), output_type="latent"))
    handle.remove()
    _, records = text_records(model, CAPTIONS[:1])
    noisy = received[0][..., :16].permute(0, 4, 1, 2, 3)
    with torch.no_grad():
        predicted = family.predict(pipe.transformer, noisy, pipe.scheduler.sigmas[0].expand(1),
                                   family.conditioning(records, [], ObjectiveParams()), torch.float32)
    assert received[0].shape == (1, 2, 4, 6, 33) and kwargs["scale_factor"] == (1, 3.16, 3.16)
    assert torch.equal(predicted, output.sample.permute(0, 4, 1, 2, 3))


def test_a_transformer_with_sparse_attention_is_refused_in_one_line(model, tmp_path):
    copy = shutil.copytree(model, tmp_path / "model")
    config = copy / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "attention_type": "nabla"}))
    with pytest.raises(UserError, match=r"transformer/config.json: attention_type 'nabla' \(sparse attention\) is not"):
        families.for_model(copy).load_denoiser(copy, torch.float32)
