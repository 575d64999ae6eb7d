"""The LTX-2.5 family against its modular pipeline's blocks on the tiny offline LTX-2.5 (an
LTX25ModularPipeline folder: LTX-2.3's transformer and connectors, LTX-2's VAE, the diffusion
decoder): the text record is the text block's connector output, the normalised latents are what the
decode block denormalises for the diffusion decoder, the denoiser call is the denoise block's
modality-isolation pass, the shift is the set-timesteps block's, and evaluate renders clips through
the pipeline without its prompt enhancer and duration head. The checks every family passes (exports
loading through the pipeline's own loader and meaning what was trained) are its row in
tests/family_checks.py."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from family_checks import block_pipeline, encoded_clip, first_call, quiet_pipeline, text_records, tiny_model_fixture

import lorapipe.stages.families as families
from lorapipe.stages.families import ObjectiveParams, TextOptions
from lorapipe.stages.families.tiny.ltx2 import build_tiny_ltx25

CAPTIONS = ["  a red ball rolling to the left across a green field ", "a rocket"]
LENGTH = TextOptions(max_sequence_length=16)

model = tiny_model_fixture("ltx2.5")


@dataclass(frozen=True)
class Clip:
    """What conditioning reads of a sample: its frame rate."""

    fps: float


def test_the_modular_folder_is_ltx25_and_rebuilds_alike_but_for_its_path(model, tmp_path):
    family = families.for_model(model)
    assert (family.name, family.variant.name, family.pipeline_class) == ("ltx2.5", "2.5", "LTX25ModularPipeline")
    assert not (model / "model_index.json").exists()
    again, index = build_tiny_ltx25(tmp_path / "again"), "modular_model_index.json"
    assert (again / index).read_text() == (model / index).read_text().replace(str(model), str(again))
    assert all((again / rel).read_bytes() == (model / rel).read_bytes()
               for rel in (p.relative_to(model) for p in model.rglob("*") if p.is_file()) if rel.name != index)


def test_text_records_are_the_text_blocks_connector_output(model):
    """Each caption's record is LTX2TextConditioningStep's video conditioning and mask for it, on the
    folder's Gemma and LTX-2.3 connectors (their projection to the transformer's width included)."""
    from diffusers.modular_pipelines.ltx2.modular_blocks_ltx2 import LTX2TextConditioningStep

    pipe = quiet_pipeline(model)
    block = block_pipeline(LTX2TextConditioningStep(), text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer,
                           connectors=pipe.connectors)
    _, records = text_records(model, CAPTIONS, LENGTH)
    for caption, record in zip(CAPTIONS, records):
        state = block(prompt=caption, max_sequence_length=16,
                      output=["connector_prompt_embeds", "connector_attention_mask"])
        assert record["hidden_states"].shape == (16, pipe.transformer.config.cross_attention_dim)
        assert torch.allclose(record["hidden_states"], state["connector_prompt_embeds"][0], atol=1e-6)
        assert torch.equal(record["attention_mask"], state["connector_attention_mask"][0].bool())


def test_normalised_latents_are_what_the_decode_block_hands_the_diffusion_decoder(model):
    """A 9-frame clip's posterior through the family's encoder and normalisation, packed as the
    denoise block leaves latents, is turned back into that posterior by the decode block (with the
    diffusion decoder's latent statistics) before the decoder reads it."""
    from diffusers import LTX2Pipeline
    from diffusers.modular_pipelines.ltx2.decoders import LTX2DiffusionVaeDecoderStep

    pipe = quiet_pipeline(model)
    family, _, _, mean = encoded_clip(model, pipe, 9, 64, 96)
    packed = LTX2Pipeline._pack_latents(family.latent_normalisation(model).apply(mean))
    block = block_pipeline(LTX2DiffusionVaeDecoderStep(), diffusion_decoder=pipe.diffusion_decoder)
    read = []

    def stop_at_the_input(module, args):
        read.append(args[0])
        raise DecoderRead

    handle = pipe.diffusion_decoder.decoder.register_forward_pre_hook(stop_at_the_input)
    with pytest.raises(DecoderRead):
        block(latents=packed, num_frames=9, height=64, width=96, dtype=torch.float32, output_type="pt",
              generator=torch.Generator().manual_seed(0), output="videos")
    handle.remove()
    assert torch.allclose(read[0], mean, atol=1e-5)


class DecoderRead(Exception):
    """Raised where the diffusion decoder reads its input: what it would decode is all the test needs."""


def test_denoiser_call_is_the_denoise_blocks_modality_isolation_pass(model):
    """The transformer's inputs and output in the denoise block's first modality-isolation pass (the
    video with no audio cross-attention; at 25 fps) against family.predict on the same latents, the
    cached record and sigma = t / 1000: the same timesteps and the same prediction."""
    from diffusers import LTX2Pipeline

    family, pipe = families.for_model(model), quiet_pipeline(model)
    calls = []
    handle = pipe.transformer.register_forward_hook(lambda m, a, kw, out: calls.append((kw, out)), with_kwargs=True)
    pipe([CAPTIONS[0]], generator=[torch.Generator().manual_seed(0)], num_inference_steps=2, height=64, width=32,
         num_frames=9, frame_rate=25.0, max_sequence_length=16, output_type="latent")
    handle.remove()
    kwargs, output = next((kw, out) for kw, out in calls if kw["isolate_modalities"])
    cond = family.conditioning(text_records(model, CAPTIONS[:1], LENGTH)[1], [(Clip(25.0), False)], ObjectiveParams())
    noisy = LTX2Pipeline._unpack_latents(kwargs["hidden_states"], 2, 2, 1)
    sigma, predicted = kwargs["timestep"].float() / 1000, []
    with torch.no_grad():
        _, ours, _ = first_call(pipe.transformer, lambda: predicted.append(
            family.predict(pipe.transformer, noisy, sigma, cond, torch.float32)))
    assert torch.equal(ours["timestep"], kwargs["timestep"].float())
    assert torch.allclose(LTX2Pipeline._pack_latents(predicted[0]), output[0], atol=1e-6)


def test_shift_is_the_set_timesteps_blocks(model):
    """The set-timesteps block's sigmas for a clip of 3 x 2 x 2 latent pixels are the objective's
    shifted noise levels at that token count (the block's mu), stretched to the scheduler's terminal
    sigma as its sampler stretches them."""
    from diffusers.modular_pipelines.ltx2.before_denoise import LTX2SetTimestepsStep

    pipe = quiet_pipeline(model)
    u = torch.tensor([1.0, 0.75, 0.5, 0.25])
    state = block_pipeline(LTX2SetTimestepsStep(), scheduler=pipe.scheduler)(
        num_inference_steps=4, height=64, width=64, num_frames=17, output="timesteps")
    objective = families.for_model(model).objective(model, ObjectiveParams())
    stretched = pipe.scheduler.stretch_shift_to_terminal(objective.shifted(u, 3 * 2 * 2))
    assert torch.allclose(state / 1000, stretched, atol=1e-6)


def test_evaluate_renders_clips_through_the_modular_pipeline(model):
    """Evaluate's pipeline is the folder's LTX25ModularPipeline less its prompt enhancer and duration
    head; a column of two seeds renders, per seed, what the pipeline renders for that seed alone."""
    import numpy as np

    from lorapipe.stages.evaluate.render import RenderSettings, clips_of, render_column
    from lorapipe.stages.families.modular import load_render_pipeline

    family = families.for_model(model)
    kwargs = family.render_kwargs(family.text_settings(model, LENGTH), 3.0, "") | family.clip_kwargs(model, 9, 12.0)
    renderer = load_render_pipeline(model, family, None, "cpu")
    assert {"prompt_enhancer", "duration"}.isdisjoint(renderer.pipe.blocks.sub_blocks)
    column = render_column(renderer, RenderSettings(["a rocket"], [3, 4], 2, 64, 2, kwargs))
    for seed, clip in zip([3, 4], column):
        (alone,) = clips_of(renderer(["a rocket"], generator=[torch.Generator().manual_seed(seed)],
                                     num_inference_steps=2, height=64, width=64, **kwargs))
        assert len(clip) == len(alone) == 9
        assert max(np.abs(np.asarray(a, dtype=int) - np.asarray(b, dtype=int)).max() for a, b in zip(clip, alone)) <= 1


def test_comfyui_export_with_the_gates_loads_in_diffusers_and_comfyui(model, exported_loras):
    """An all_linear LoRA takes LTX-2.3's attention gates too; its ComfyUI file names them as LTX-2's
    original layout does (`to_gate_logits`, as diffusers' converter keeps it), and both diffusers'
    LTX-2 loader and ComfyUI's key map apply the trained model."""
    from comfyui_keys import assert_comfyui_applies_the_merged_model
    from family_checks import assert_means_what_was_trained, fused_change, keys_of

    transformer, targets, written = exported_loras("ltx2.5")
    keys = keys_of(written[1])
    assert "diffusion_model.transformer_blocks.1.attn2.to_gate_logits.lora_A.weight" in keys
    assert len(keys) == 2 * len(targets)
    assert_means_what_was_trained(transformer, targets, fused_change(quiet_pipeline(model), "transformer", written[1]))
    assert_comfyui_applies_the_merged_model(written[1], transformer, families.for_model(model))


def test_the_diffusion_decoder_keys_evaluate_alone(model, tmp_path):
    """Only rendering reads the diffusion decoder: it is in evaluate's key, not in encode's or train's,
    so new decoder weights render again and re-encode and retrain nothing."""
    import yaml

    from lorapipe.flows.config import load_config
    from lorapipe.flows.steps import Context

    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"name": "keys", "cache_dir": "cache", "output_dir": "out",
                                      "model": {"path": str(model)}, "data": {"path": str(tmp_path)},
                                      "preprocess": {"resolution": 64}, "train": {},
                                      "evaluate": {"prompts": ["a cat"]}}))
    ctx = Context(load_config(config), log=lambda line: None)
    try:
        keyed = {stage: set(ctx.models_for(stage)) for stage in ("encode", "train", "evaluate")}
    finally:
        ctx.close()
    assert "diffusion_decoder" in keyed["evaluate"] and keyed["encode"] | keyed["train"] <= keyed["evaluate"]
    assert "diffusion_decoder" not in keyed["encode"] | keyed["train"]
