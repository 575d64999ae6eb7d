"""The LTX-2 family against LTX2Pipeline on the tiny offline LTX-2: the cached text record is what the
pipeline's connectors make of its Gemma prompt embeddings, the latents' per-channel normalisation is
what the pipeline inverts before decoding, the frame rule is the VAE's temporal compression, the
denoiser call is the pipeline's video-only (modality-isolation) call at the clip's frame rate, the
shift counts every frame's tokens, and the exports load through diffusers' own loader and ComfyUI's
key map and mean what was trained."""
from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass

import numpy
import pytest
import torch
from comfyui_keys import assert_comfyui_applies_the_merged_model
from family_checks import assert_builds_byte_identically, assert_means_what_was_trained, encoded_clip, first_call, \
    fused_change, keys_of, quiet_pipeline, text_records, tiny_model_fixture, trained_lora
from test_adapters import exported_comfyui_file, trained_adapter

import lorapipe.stages.families as families
from lorapipe.stages.evaluate.render import clips_of
from lorapipe.stages.families import ObjectiveParams, TextOptions
from lorapipe.stages.train.adapter import AdapterParams

CAPTIONS = ["  a red ball rolling to the left across a green field ", "a rocket", ""]


@dataclass(frozen=True)
class Clip:
    """What conditioning reads of a sample: its frame rate (0: an image)."""

    fps: float


model = tiny_model_fixture("ltx2")
i2v_model = tiny_model_fixture("ltx2-i2v")


def test_tiny_ltx2_builds_byte_identically_and_is_told_apart(model, tmp_path):
    files = assert_builds_byte_identically(model, "ltx2", tmp_path / "again")
    assert {"connectors/diffusion_pytorch_model.safetensors", "tokenizer/tokenizer.json"} <= set(files)
    family = families.for_model(model)
    assert (family.name, family.variant.tiny_arch, family.components.text) == \
        ("ltx2", "ltx2", ("text_encoder", "tokenizer", "connectors"))
    assert (family.geometry(model).downsampling, family.geometry(model).pixel_multiple) == (32, 32)
    assert (family.variant.render_steps, family.variant.render_guidance, family.sampler) == \
        (30, 3.0, "flow_match_euler")


def test_a_folder_named_ltx2_in_the_working_directory_does_not_hide_the_connectors(tmp_path, monkeypatch):
    """`lorapipe demo --arch ltx2 --workdir ltx2` through `python -m` (the working directory first on
    sys.path): the connectors' library "ltx2" is diffusers' pipeline module, not that folder."""
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    from lorapipe.stages.families.folders import component_class

    (tmp_path / "ltx2" / "model").mkdir(parents=True)
    (tmp_path / "ltx2" / "model" / "model_index.json").write_text(
        json.dumps({"_class_name": "LTX2Pipeline", "connectors": ["ltx2", "LTX2TextConnectors"]}))
    monkeypatch.syspath_prepend(tmp_path)
    monkeypatch.delitem(sys.modules, "ltx2", raising=False)
    try:
        assert component_class(tmp_path / "ltx2" / "model", "connectors") is LTX2TextConnectors
    finally:
        sys.modules.pop("ltx2", None)  # the folder, imported as a namespace package without the fix


@pytest.mark.parametrize("length", [None, 16])
def test_text_records_are_what_the_pipelines_connectors_make(model, length):
    """A record is the video connector's output for the stripped caption left-padded to the pipeline's
    max_sequence_length (1024, or encode.max_sequence_length) and its mask: stacked, exactly the
    text embedding and mask the pipeline gives its transformer."""
    family, records = text_records(model, CAPTIONS, TextOptions(max_sequence_length=length))
    pipe = quiet_pipeline(model)
    with torch.no_grad():
        embeds, mask, _, _ = pipe.encode_prompt(CAPTIONS, do_classifier_free_guidance=False,
                                                max_sequence_length=length or 1024)
        video, _, video_mask = pipe.connectors(embeds, mask, padding_side="left")
    cond = family.conditioning(records, [(Clip(16.0), False)] * 3, ObjectiveParams())
    assert cond["encoder_hidden_states"].shape == (3, length or 1024, 16)
    assert torch.equal(cond["encoder_hidden_states"], video)
    assert torch.equal(cond["encoder_attention_mask"], video_mask.float())
    assert torch.equal(cond["frame_rate"], torch.tensor([16.0] * 3))


def test_text_records_of_a_text_stage_stored_in_bf16_are_the_pipelines(model, tmp_path):
    """Published LTX-2 stores Gemma and the connectors in bf16: transformers loads Gemma as stored and
    diffusers the connectors in float32 unless told, so the connectors are loaded in Gemma's dtype
    (the tiny model, stored in float32, cannot tell); the record is the bf16 pipeline's."""
    from diffusers import LTX2Pipeline

    from lorapipe.stages.families.folders import load_component

    stored = tmp_path / "bf16"
    shutil.copytree(model, stored)
    family = families.for_model(stored)
    for part in ("text_encoder", "connectors"):
        load_component(stored, part).to(torch.bfloat16).save_pretrained(stored / part)
    records = family.text_encoder(stored, family.text_settings(stored, TextOptions(max_sequence_length=16)),
                                  torch.float32, "cpu")(CAPTIONS[:2])
    pipe = LTX2Pipeline.from_pretrained(stored, dtype=torch.bfloat16)
    with torch.no_grad():
        embeds, mask, _, _ = pipe.encode_prompt(CAPTIONS[:2], do_classifier_free_guidance=False,
                                                max_sequence_length=16)
        video, _, _ = pipe.connectors(embeds, mask, padding_side="left")
    assert torch.equal(torch.stack([r["hidden_states"] for r in records]), video.float())


def test_text_lengths_the_connectors_cannot_take_are_refused(model):
    """The connectors replace the padding with their 8 registers at a time: a max_sequence_length that
    is not a multiple is refused naming the key, before any encoding."""
    family = families.for_model(model)
    assert family.text_settings(model, TextOptions()).model_dump() == {"max_sequence_length": 1024}
    with pytest.raises(ValueError, match=r"encode.max_sequence_length: .* 8 learnable registers .* not 12"):
        family.text_settings(model, TextOptions(max_sequence_length=12))
    encoder = family.text_encoder(model, family.text_settings(model, TextOptions(max_sequence_length=8)),
                                       torch.float32, "cpu")
    assert encoder.too_long(CAPTIONS[0]) and not encoder.too_long(CAPTIONS[1])


def test_latents_and_their_normalisation_are_the_pipelines(model):
    """A 9-frame clip and a one-frame image through the family's encoder are the VAE's posterior,
    (C, F', H', W'); normalised per channel (the VAE's latents_mean/latents_std buffers), they are what
    LTX2Pipeline turns back into the VAE's latents before decoding (the decoder's first input)."""
    from diffusers import LTX2Pipeline

    pipe = quiet_pipeline(model)
    family, encoder, clip, mean = encoded_clip(model, pipe, 9, 64, 96)
    assert mean.shape == (1, 8, 2, 2, 3)
    assert torch.equal(encoder(clip[:, :, 0])[0], encoder(clip[:, :, :1])[0])  # an image is a one-frame clip
    normalised = LTX2Pipeline._pack_latents(family.latent_normalisation(model).apply(mean))

    def replace_latents(pipe, step, t, tensors):
        return {"latents": normalised}

    args, _, _ = first_call(pipe.vae.decoder.conv_in, lambda: pipe(
        "a cat", num_inference_steps=2, height=64, width=96, num_frames=9, guidance_scale=1.0,
        callback_on_step_end=replace_latents, output_type="pt"))
    assert torch.allclose(args[0], mean, atol=1e-5)


def test_window_lengths_follow_the_vaes_temporal_compression(model, tmp_path):
    """8k+1 frames from the VAE config's temporal_compression_ratio; without one, the ratio the VAE
    computes itself (its patch_size_t times 2 per downsampling block), which the pipeline reads."""
    from diffusers import AutoencoderKLLTX2Video

    family = families.for_model(model)
    assert family.frames_problem(model, 9) is None and family.frames_problem(model, 0) is None
    assert family.frames_problem(model, 8) == "LTX-2 takes windows of 8k+1 frames (1, 9, 17, ...), not 8"
    shutil.copytree(model, tmp_path / "m")
    config_file = tmp_path / "m" / "vae" / "config.json"
    config = json.loads(config_file.read_text())
    config.update(temporal_compression_ratio=None, spatial_compression_ratio=None)
    config_file.write_text(json.dumps(config))
    vae = AutoencoderKLLTX2Video.from_config(config)
    assert (family.temporal_compression(tmp_path / "m"), family.geometry(tmp_path / "m").downsampling) == \
        (vae.temporal_compression_ratio, vae.spatial_compression_ratio) == (16, 64)


def test_denoiser_call_is_the_pipelines_video_without_audio(model):
    """The transformer's inputs and output in LTX2Pipeline's first modality-isolation pass (its
    video with no audio cross-attention; two prompts at 25 fps) against family.predict on the same
    latents, the cached records and sigma = t / 1000, the clips' frame rate from their samples: the
    same timesteps and the same prediction, whatever the audio stream holds."""
    from diffusers import LTX2Pipeline

    family, pipe = families.for_model(model), quiet_pipeline(model)
    calls = []
    handle = pipe.transformer.register_forward_hook(lambda m, a, kw, out: calls.append((kw, out)), with_kwargs=True)
    pipe(CAPTIONS[:2], num_inference_steps=2, height=64, width=32, num_frames=9, frame_rate=25.0,
         guidance_scale=1.0, max_sequence_length=16, generator=torch.Generator().manual_seed(0), output_type="latent")
    handle.remove()
    kwargs, output = next((kw, out) for kw, out in calls if kw["isolate_modalities"])
    cond = family.conditioning(text_records(model, CAPTIONS[:2], TextOptions(max_sequence_length=16))[1],
                               [(Clip(25.0), False)] * 2, ObjectiveParams())
    noisy = LTX2Pipeline._unpack_latents(kwargs["hidden_states"], 2, 2, 1)
    sigma, predicted = kwargs["timestep"].float() / 1000, []
    with torch.no_grad():
        _, ours, _ = first_call(pipe.transformer, lambda: predicted.append(
            family.predict(pipe.transformer, noisy, sigma, cond, torch.float32)))
        audio = torch.randn_like(kwargs["audio_hidden_states"])
        other_audio = pipe.transformer(**{**kwargs, "audio_hidden_states": audio})
    assert torch.equal(ours["timestep"], kwargs["timestep"].float())
    assert torch.equal(LTX2Pipeline._pack_latents(predicted[0]), output[0])
    assert torch.equal(other_audio[0], output[0])


def test_image_to_video_condition_and_denoiser_call_are_the_pipelines(i2v_model):
    """LTX2ImageToVideoPipeline's first modality-isolation pass on an image (without the H.264
    re-compression it applies by default: a training window's first frame is a video frame already):
    its first latent frame is the normalised posterior mean of the image alone through our encoder
    (without the VAE's scaling_factor, as the pipeline normalises it), its tokens at timestep 0,
    and family.predict on its noisy latents (that frame replaced by the condition) is its output; the
    loss scores the frames after it."""
    from diffusers import LTX2Pipeline
    from PIL import Image

    from lorapipe.stages.encode.images import condition_clip
    from lorapipe.stages.families.base import REFERENCE_LATENTS

    family, pipe = families.for_model(i2v_model), quiet_pipeline(i2v_model)
    assert (family.name, family.max_references, family.image_condition.padded) == ("ltx2-i2v", 1, False)
    pixels = torch.rand(3, 64, 32, generator=torch.Generator().manual_seed(5)) * 2 - 1
    image = Image.fromarray(((pixels + 1) * 127.5).round().byte().permute(1, 2, 0).numpy())
    pixels = torch.from_numpy(numpy.array(image)).permute(2, 0, 1).float() / 127.5 - 1
    calls = []
    handle = pipe.transformer.register_forward_hook(lambda m, a, kw, out: calls.append((kw, out)), with_kwargs=True)
    pipe(image=image, prompt=CAPTIONS[:1], num_inference_steps=2, height=64, width=32, num_frames=9, image_crf=0,
         frame_rate=25.0, guidance_scale=1.0, max_sequence_length=16, generator=torch.Generator().manual_seed(0),
         output_type="latent")
    handle.remove()
    kwargs, output = next((kw, out) for kw, out in calls if kw["isolate_modalities"])
    mean, _ = family.load_latent_encoder(i2v_model, "cpu")(condition_clip(pixels, 1).unsqueeze(0))
    reference = family.latent_normalisation(i2v_model).apply(mean)  # as the record reaches predict
    noisy = LTX2Pipeline._unpack_latents(kwargs["hidden_states"], 2, 2, 1)
    assert torch.allclose(noisy[:, :, :1], reference * family.condition_scale, atol=1e-5)  # no scaling_factor
    cond = family.conditioning(text_records(i2v_model, CAPTIONS[:1], TextOptions(max_sequence_length=16))[1],
                               [(Clip(25.0), False)], ObjectiveParams())
    cond[REFERENCE_LATENTS] = reference.unsqueeze(1)
    sigma, predicted = kwargs["sigma"].float() / 1000, []
    with torch.no_grad():
        _, ours, _ = first_call(pipe.transformer, lambda: predicted.append(
            family.predict(pipe.transformer, noisy, sigma, cond, torch.float32)))
    assert (kwargs["timestep"][:, :2] == 0).all() and (kwargs["timestep"][:, 2:] > 0).all()
    assert torch.equal(ours["timestep"], kwargs["timestep"].float())
    assert torch.allclose(LTX2Pipeline._pack_latents(predicted[0]), output[0], atol=1e-5)
    assert [t.shape[2] for t in family.loss_region(predicted[0], noisy)] == [1, 1]


def test_shift_is_the_pipelines_and_counts_every_frame(model):
    """Resolution-dependent shift as LTX2Pipeline shifts its sigmas: mu linear in the token count from
    the scheduler config's (1024, 0.95) to (4096, 2.05), the tokens of a clip being frames x height x
    width latent pixels; the objective noises 5-D latents per sample."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

    objective = families.for_model(model).objective(model, ObjectiveParams())
    assert (objective.sampling.shift, objective.base_seq_len, objective.max_seq_len) == ("resolution", 1024, 4096)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(model, subfolder="scheduler")
    u = torch.tensor([0.9, 0.5, 0.1])
    mu = calculate_shift(3 * 4 * 6, 1024, 4096, 0.95, 2.05)
    assert torch.allclose(objective.shifted(u, 3 * 4 * 6), scheduler.time_shift(mu, 1.0, u))
    latents = torch.randn(2, 8, 3, 4, 6, generator=torch.Generator().manual_seed(0))
    t = objective.sample_timesteps(tuple(latents.shape), torch.Generator().manual_seed(1))
    assert torch.equal(t, objective.shifted(torch.rand(2, generator=torch.Generator().manual_seed(1)), 3 * 4 * 6))
    noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(2))
    noised = objective.noised(latents, noise, t)
    assert torch.equal(noised.noisy[1], (1 - t[1]) * latents[1] + t[1] * noise[1])


def test_comfyui_export_loads_in_diffusers_and_comfyui(model, exported_loras):
    """LTX-2's original names under `diffusion_model.` (transformer_blocks.N.attn1.to_q, ff.net.2), the
    scale in lora_B and no `.alpha`: read by LTX2Pipeline's non-diffusers converter and by ComfyUI,
    both applying the trained model."""
    transformer, targets, written = exported_loras("ltx2")
    keys = keys_of(written[1])
    assert {"diffusion_model.transformer_blocks.0.attn1.to_q.lora_A.weight",
            "diffusion_model.transformer_blocks.1.ff.net.2.lora_B.weight"} <= keys and len(keys) == 2 * len(targets)
    assert_means_what_was_trained(transformer, targets, fused_change(quiet_pipeline(model), "transformer", written[1]))
    assert_comfyui_applies_the_merged_model(written[1], transformer, families.for_model(model))


def test_modules_outside_the_blocks_are_exported_in_ltx2s_names(model, tmp_path):
    """A LoRA on the patchify projection and the timestep embedder is written under LTX-2's own
    names (patchify_proj, adaln_single), which diffusers' loader renames back: the derived names are
    the converter's."""
    family = families.for_model(model)
    targets = ("proj_in", "time_embed.linear", "transformer_blocks.0.attn2.to_k")
    transformer, _ = trained_lora(family, model, targets)
    comfy = family.export_lora(transformer, tmp_path, {}, {})[1]
    assert {"diffusion_model.patchify_proj.lora_A.weight", "diffusion_model.adaln_single.linear.lora_B.weight"} \
        <= keys_of(comfy)
    assert_means_what_was_trained(transformer, list(targets), fused_change(quiet_pipeline(model), "transformer", comfy))


@pytest.mark.parametrize("kind", ["dora", "lokr", "loha"])
def test_lycoris_types_are_written_for_comfyui(kind, model, tmp_path):
    family = families.for_model(model)
    transformer = trained_adapter(family, model, AdapterParams(adapter=kind, rank=2, alpha=3), "attention_ff")
    assert_comfyui_applies_the_merged_model(exported_comfyui_file(family, transformer, tmp_path), transformer, family)


def test_the_pipeline_renders_with_the_familys_arguments(model):
    """evaluate's render arguments (guidance, negative prompt, text length, the clip's frames: 121 by
    default, evaluate.num_frames when of LTX-2's 8k+1 form, at the frame rate the clip renders at) are
    LTX2Pipeline's, and its output is read as clips."""
    family = families.for_model(model)
    kwargs = family.render_kwargs(family.text_settings(model, TextOptions(max_sequence_length=16)), 3.0, "blurry")
    assert kwargs == {"guidance_scale": 3.0, "negative_prompt": "blurry", "max_sequence_length": 16}
    assert family.clip_kwargs(model, None, 24.0) == {"num_frames": 121, "frame_rate": 24.0}
    assert family.clip_kwargs(model, None, 12.0) == {"num_frames": 121, "frame_rate": 12.0}
    with pytest.raises(ValueError, match=r"evaluate.num_frames: LTX-2 takes windows of 8k\+1 frames .*, not 8"):
        family.clip_kwargs(model, 8, 24.0)
    kwargs |= family.clip_kwargs(model, 9, 24.0)
    assert family.clip_fps == 24
    pipe = quiet_pipeline(model)
    family.prepare_pipeline(pipe, family.sampler, None)
    clips = clips_of(pipe(["a cat"], num_inference_steps=2, height=64, width=96, output_type="pil",
                                 generator=[torch.Generator().manual_seed(0)],
                                 **{**kwargs, "negative_prompt": ["blurry"]}))
    assert len(clips) == 1 and len(clips[0]) == 9 and clips[0][0].size == (96, 64)
