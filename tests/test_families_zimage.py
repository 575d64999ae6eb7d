"""The Z-Image family against ZImagePipeline on the tiny offline Z-Image: the cached text record
(unpadded, padded per batch by the family) is what inference encodes, the latent normalisation and
the denoiser call are the pipeline's, the shift comes from the scheduler config (base 6, Turbo 3),
Turbo is known as distilled, and both LoRA exports load through diffusers' own loaders and mean
what was trained."""
from __future__ import annotations


import pytest
import torch
from comfyui_keys import assert_comfyui_applies_the_merged_model
from family_checks import CAPTIONS, assert_builds_byte_identically, assert_means_what_was_trained, first_call, \
    fused_change, keys_of, quiet_pipeline, text_records, tiny_model_fixture

import lorapipe.stages.families as families
from lorapipe.stages.families import ObjectiveParams, TextOptions


base, turbo = tiny_model_fixture("z-image"), tiny_model_fixture("z-image-turbo")


def test_tiny_zimage_builds_byte_identically_and_loads(base, tmp_path):
    files = assert_builds_byte_identically(base, "z-image", tmp_path / "again")
    assert {"tokenizer/tokenizer.json", "tokenizer/chat_template.jinja"} <= set(files)
    pipe = quiet_pipeline(base)
    text = pipe.tokenizer.apply_chat_template([{"role": "user", "content": "A cat!"}], tokenize=False,
                                              add_generation_prompt=True, enable_thinking=True)
    assert text == "<|im_start|>user\nA cat!<|im_end|>\n<|im_start|>assistant\n"  # Qwen3's rendering


def test_variants_are_told_apart_by_the_scheduler(base, turbo):
    b, t = families.for_model(base), families.for_model(turbo)
    assert (b.name, b.bound.name, t.bound.name) == ("z-image", "base", "turbo")
    assert t.bound.distilled and t.variant.train_instead == "Tongyi-MAI/Z-Image" and b.variant.train_instead is None
    assert (b.variant.render_steps, t.variant.render_steps) == (50, 9)
    assert b.geometry(base).pixel_multiple == 16
    settings = b.text_settings(base, TextOptions())
    assert (settings.hidden_layers, settings.max_sequence_length, settings.keep_padding) == ((-2,), 512, False)
    with pytest.raises(ValueError, match="evaluate.negative_prompt"):
        t.render_kwargs(settings, 0.0, "blurry")


def test_text_records_are_what_the_pipeline_encodes(base):
    """Records hold the caption's own tokens (unpadded); the family pads a batch with zeros and a mask,
    and the transformer gets back exactly the pipeline's list of prompt embeddings."""
    family, records = text_records(base, CAPTIONS)
    with torch.no_grad():
        embeds, _ = quiet_pipeline(base).encode_prompt(list(CAPTIONS), do_classifier_free_guidance=False)
    lengths = [r["hidden_states"].shape[0] for r in records]
    assert len(set(lengths)) == 3 and all(r["hidden_states"].shape[1] == 16 for r in records)
    for record, expected in zip(records, embeds):
        assert torch.equal(record["hidden_states"], expected)
    cond = family.conditioning(records, [], ObjectiveParams())
    assert cond["cap_feats"].shape == (3, max(lengths), 16) and cond["cap_mask"].sum(1).tolist() == lengths
    for i, expected in enumerate(embeds):
        assert torch.equal(cond["cap_feats"][i][cond["cap_mask"][i]], expected)
        assert not cond["cap_feats"][i][~cond["cap_mask"][i]].any()


def test_latent_normalisation_is_the_pipelines(base):
    family, pipe = families.for_model(base), quiet_pipeline(base)
    pixels = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(3)) * 2 - 1
    mean, _ = family.load_latent_encoder(base, "cpu")(pixels)
    normalise = family.latent_normalisation(base)
    with torch.no_grad():
        expected = pipe.vae.encode(pixels).latent_dist.mode()
    assert torch.equal(mean, expected)
    decoded_input = normalise.apply(mean) / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
    assert torch.allclose(decoded_input, mean, atol=1e-6)  # ZImagePipeline decodes z / scale + shift


@pytest.mark.parametrize("variant", ["base", "turbo"])
def test_denoiser_call_is_the_pipelines(variant, base, turbo):
    """The transformer's inputs and output in ZImagePipeline's first step (two prompts of different
    lengths, no CFG), against family.predict on the stacked latents, the cached records padded by the
    family and the scheduler's sigma: the same prediction, negated into noise - x0."""
    model = base if variant == "base" else turbo
    family, pipe = families.for_model(model), quiet_pipeline(model)
    args, _, output = first_call(pipe.transformer, lambda: pipe(
        CAPTIONS[:2], num_inference_steps=2, height=64, width=48, guidance_scale=0.0,
        generator=torch.Generator().manual_seed(0), output_type="latent"))
    settings = family.text_settings(model, TextOptions())
    records = family.text_encoder(model, settings, torch.float32, "cpu")(CAPTIONS[:2])
    cond = family.conditioning(records, [], ObjectiveParams())
    noisy = torch.stack(args[0]).squeeze(2)
    sigma = pipe.scheduler.sigmas[0].expand(2)
    with torch.no_grad():
        predicted = family.predict(pipe.transformer, noisy, sigma, cond, torch.float32)
    assert noisy.shape == (2, 16, 8, 6)
    assert torch.equal(predicted, -torch.stack(output[0]).squeeze(2))


def test_shift_is_the_schedulers(base, turbo):
    """Static shift from the scheduler config (base 6, Turbo 3), as FlowMatchEulerDiscreteScheduler
    shifts the sigmas ZImagePipeline samples."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    u = torch.tensor([0.9, 0.5, 0.1])
    for model, shift in ((base, 6.0), (turbo, 3.0)):
        objective = families.for_model(model).objective(model, ObjectiveParams())
        assert (objective.sampling.shift, objective.sampling.shift_value) == ("static", shift)
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(model, subfolder="scheduler")
        scheduler.set_timesteps(sigmas=u.tolist())
        assert torch.allclose(objective.shifted(u, 16), scheduler.sigmas[:-1])


def test_comfyui_export_loads_in_diffusers_and_comfyui(base, exported_loras):
    """ComfyUI's names for Z-Image LoRAs, diffusers' own under `diffusion_model.` (attention.to_q,
    to_out.0, feed_forward.w1-3, adaLN_modulation.0), the scale in lora_B and no `.alpha`: ZImagePipeline
    .load_lora_weights reads the file as it is (its converter leaves fused `attention.qkv` and `.alpha`
    keys of this spelling unread or refused), and ComfyUI maps every key onto its rows of the fused
    weights; both apply the trained model."""
    family = families.for_model(base)
    transformer, targets, written = exported_loras("z-image")
    comfy = written[1]
    keys = keys_of(comfy)
    modules = {k.removeprefix("diffusion_model.").rsplit(".", 2)[0] for k in keys}
    assert modules == set(targets) and len(keys) == 2 * len(targets)
    assert "diffusion_model.layers.0.attention.to_q.lora_A.weight" in keys
    assert_means_what_was_trained(transformer, targets, fused_change(quiet_pipeline(base), "transformer", comfy))
    assert_comfyui_applies_the_merged_model(comfy, transformer, family)


def test_evaluate_renders_with_guidance_and_no_negative_prompt(base):
    """evaluate's render call with the family's pipeline arguments: with guidance and no negative
    prompt (evaluate.negative_prompt unset) the base model renders (it passed [None] as the negative
    prompts, and the pipeline's chat template failed on it)."""
    from lorapipe.stages.evaluate.render import RenderSettings, render_column

    family = families.for_model(base)
    text = family.text_settings(base, TextOptions())
    settings = RenderSettings(["a photo of a cat"], [0], 1, 32, 1, family.render_kwargs(text, 4.0, ""))
    assert [[image.size for image in clip] for clip in render_column(quiet_pipeline(base), settings)] == [[(32, 32)]]
