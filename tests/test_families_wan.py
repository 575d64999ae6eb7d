"""The Wan family against WanPipeline on the tiny offline Wan 2.1 T2V, Wan 2.2 TI2V-5B and A14B: the cached
text record (cleaned as the pipeline cleans prompts, unpadded, zero-padded by the family to the
pipeline's max_sequence_length) is what inference encodes, the 3-D latents' per-channel
normalisation is what the pipeline inverts before decoding, the denoiser call is the pipeline's
(TI2V-5B's timestep per token included; A14B's expert for each noise level), the shift is the UniPC
scheduler's flow_shift, A14B trains one expert per LoRA on its noise levels only, and the three LoRA
exports load through diffusers' own loader (A14B's low-noise one into transformer_2) and ComfyUI's
key map and mean what was trained."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from comfyui_keys import assert_comfyui_applies_the_merged_model
from family_checks import assert_builds_byte_identically, assert_means_what_was_trained, first_call, fused_change, \
    keys_of, quiet_pipeline, text_records, trained_lora
from safetensors import safe_open
from test_adapters import exported_comfyui_file, trained_adapter

import lorapipe.stages.families as families
from lorapipe.cache.errors import UserError
from lorapipe.stages.evaluate.render import clips_of
from lorapipe.stages.families import ObjectiveParams, TextOptions
from lorapipe.stages.train.adapter import AdapterParams

CAPTIONS = ["a photo of a tabby cat   looking to the side &amp; up", "a rocket", ""]  # the first needs cleaning
ARCHES = ("wan2.1", "wan2.2-5b", "wan2.2-a14b")


@pytest.fixture(scope="module")
def models(tiny_models) -> dict[str, Path]:
    return {arch: tiny_models(arch) for arch in ARCHES}



@pytest.mark.parametrize("arch", ARCHES)
def test_tiny_wan_builds_byte_identically_and_is_told_apart(arch, models, tmp_path):
    assert "vae/diffusion_pytorch_model.safetensors" in assert_builds_byte_identically(models[arch], arch,
                                                                                          tmp_path / "again")
    family = families.for_model(models[arch])
    five_b, a14b = arch == "wan2.2-5b", arch == "wan2.2-a14b"
    assert (family.name, family.variant.tiny_arch, family.bound.per_token_timesteps) == ("wan", arch, five_b)
    assert (family.bound.boundary_ratio, family.components.denoisers()) == \
        ((0.875, ("transformer", "transformer_2")) if a14b else (None, ("transformer",)))
    assert (family.geometry(models[arch]).downsampling, family.geometry(models[arch]).pixel_multiple) == \
        ((16, 32) if five_b else (8, 16))
    steps, guidance = (40, 4.0) if a14b else (50, 5.0)
    assert (family.variant.render_steps, family.variant.render_guidance, family.sampler) == \
        (steps, guidance, "flow_unipc")


def test_a14b_shares_wan21s_encoders_so_encode_records_are_reused(models):
    """The tiny A14B's text encoder, tokenizer and VAE are the tiny Wan 2.1's, byte for byte (as the
    real A14B uses Wan 2.1's VAE); its two experts differ."""
    def files(arch, part):
        return {p.relative_to(models[arch]): p.read_bytes() for p in (models[arch] / part).rglob("*") if p.is_file()}

    for part in ("text_encoder", "tokenizer", "vae"):
        assert files("wan2.2-a14b", part) == files("wan2.1", part)
    experts = [(models["wan2.2-a14b"] / name / "diffusion_pytorch_model.safetensors").read_bytes()
               for name in ("transformer", "transformer_2")]
    assert experts[0] != experts[1]


def test_train_denoiser_is_refused_in_one_line_where_it_does_not_apply(models, tmp_path):
    """A model with one denoiser takes no train.denoiser (not both either); A14B needs one of its
    experts, or both (each bound as when chosen alone); a model index with a transformer_2 but no
    boundary_ratio names the file."""
    for choice in ("low_noise", "both"):
        with pytest.raises(UserError, match=r"^train.denoiser: Wan has one denoiser, there is none to choose; remove"
                                            rf" it \(it is '{choice}'\)$"):
            families.for_model(models["wan2.1"]).trained_denoisers(choice)
    a14b = families.for_model(models["wan2.2-a14b"])
    for choice, said in ((None, ""), ("all", " (not 'all')")):
        with pytest.raises(UserError, match=r"^train.denoiser: this Wan model has 2 denoisers, each trained by a LoRA"
                                            rf" of its own: set it to one of high_noise, low_noise or both"
                                            rf"{re.escape(said)}$"):
            a14b.trained_denoisers(choice)
    both = a14b.trained_denoisers("both")
    assert {name: f.components.denoiser for name, f in both.items()} == \
        {"high_noise": "transformer", "low_noise": "transformer_2"}
    assert all(f.chosen == a14b.with_denoiser(name).chosen for name, f in both.items())
    model = tmp_path / "no-boundary"
    shutil.copytree(models["wan2.2-a14b"], model)
    index = json.loads((model / "model_index.json").read_text())
    (model / "model_index.json").write_text(json.dumps({**index, "boundary_ratio": None}))
    with pytest.raises(UserError, match=r"no-boundary/model_index.json: a Wan model with a transformer_2 needs the"
                                        r" boundary_ratio \(between 0 and 1\) where the pipeline switches to it"):
        families.for_model(model)


@pytest.mark.parametrize("choice, component", [("high_noise", "transformer"), ("low_noise", "transformer_2")])
def test_each_a14b_expert_predicts_as_the_pipeline_at_its_noise_levels_only(choice, component, models):
    """Over a 12-step render, WanPipeline calls `transformer` at t >= 875 and `transformer_2` below;
    the chosen expert is the component the pipeline calls in its range, family.predict with it is the
    pipeline's prediction there, and training draws noise levels only in that range."""
    model = models["wan2.2-a14b"]
    family, pipe = families.for_model(model).with_denoiser(choice), quiet_pipeline(model)
    assert family.components.denoiser == component and family.components.adapter_prefix() == "transformer"
    calls = {name: [] for name in ("transformer", "transformer_2")}
    handles = [getattr(pipe, name).register_forward_hook(
        lambda _, args, kwargs, out, name=name: calls[name].append((kwargs, out)), with_kwargs=True) for name in calls]
    pipe(CAPTIONS[:1], num_inference_steps=12, height=32, width=32, num_frames=5, guidance_scale=1.0,
         generator=torch.Generator().manual_seed(0), output_type="latent")
    for handle in handles:
        handle.remove()
    assert all(k["timestep"] >= 875 for k, _ in calls["transformer"]) and calls["transformer"]
    assert all(k["timestep"] < 875 for k, _ in calls["transformer_2"]) and calls["transformer_2"]
    objective = family.objective(model, ObjectiveParams())
    cond = family.conditioning(text_records(model, CAPTIONS[:1])[1], [], ObjectiveParams())
    for kwargs, output in calls[component]:
        sigma = kwargs["timestep"].float() / 1000
        assert objective.in_range(sigma).all()
        with torch.no_grad():
            predicted = family.predict(getattr(pipe, component), kwargs["hidden_states"], sigma, cond, torch.float32)
        assert torch.equal(predicted, output[0])
    drawn = objective.sample_timesteps((256, 16, 2, 4, 4), torch.Generator().manual_seed(0))
    assert ((drawn >= 0.875) == (choice == "high_noise")).all() and len(drawn.unique()) == 256
    assert objective.steps_scored([100, 500, 874, 875, 900]) == ([875, 900] if choice == "high_noise" else
                                                                 [100, 500, 874])


@pytest.mark.parametrize("length", [None, 16])
def test_text_records_are_what_the_pipeline_encodes(models, length):
    """Records hold each cleaned caption's own tokens; the family pads a batch with zeros to the
    pipeline's max_sequence_length (the default 512, or encode.max_sequence_length), unmasked, and
    gets exactly the pipeline's prompt embeddings."""
    model = models["wan2.1"]
    family, records = text_records(model, CAPTIONS, TextOptions(max_sequence_length=length))
    with torch.no_grad():
        embeds, _ = quiet_pipeline(model).encode_prompt(list(CAPTIONS), do_classifier_free_guidance=False,
                                                   max_sequence_length=length or 512)
    cond = family.conditioning(records, [], ObjectiveParams())
    assert set(cond) == {"encoder_hidden_states"} and cond["encoder_hidden_states"].shape == (3, length or 512, 32)
    assert torch.equal(cond["encoder_hidden_states"], embeds)
    lengths = [r["hidden_states"].shape[0] for r in records]
    assert lengths == [int(n) for n in embeds.abs().sum(-1).gt(0).sum(1)] and len(set(lengths)) == 3


def test_captions_are_cleaned_with_the_ftfy_the_text_settings_name(models):
    """ftfy changes what WanPipeline's prompt_clean does, so its version is a text setting (in every
    record's key), and an encoder whose process cleans otherwise than the settings say refuses."""
    model = models["wan2.1"]
    family = families.for_model(model)
    settings = family.text_settings(model, TextOptions())
    assert settings.model_dump() == {"max_sequence_length": 512, "ftfy": None}  # ftfy is not installed here
    with pytest.raises(UserError, match=r"encode: the text settings clean captions with ftfy 6.3.1, this process has"
                                        r" ftfy \(none\)"):
        family.text_encoder(model, settings.model_copy(update={"ftfy": "6.3.1"}), torch.float32, "cpu")
    encoder = family.text_encoder(model, family.text_settings(model, TextOptions(max_sequence_length=8)),
                                       torch.float32, "cpu")
    assert encoder.too_long(CAPTIONS[0]) and not encoder.too_long(CAPTIONS[1])


@pytest.mark.parametrize("arch", ARCHES)
def test_latents_and_their_normalisation_are_the_pipelines(arch, models):
    """A 5-frame clip and a one-frame image through the family's encoder are the VAE's posterior,
    (C, F', H', W'); normalised per channel, they are what WanPipeline turns back into the VAE's
    latents before decoding (the decoder's first input, caught by a hook)."""
    model = models[arch]
    family, pipe = families.for_model(model), quiet_pipeline(model)
    encoder = family.load_latent_encoder(model, "cpu")
    clip = torch.rand(1, 3, 5, 64, 32, generator=torch.Generator().manual_seed(3)) * 2 - 1
    mean, std = encoder(clip)
    side = 16 if arch == "wan2.2-5b" else 8
    assert mean.shape == std.shape == (1, 48 if arch == "wan2.2-5b" else 16, 2, 64 // side, 32 // side)
    with torch.no_grad():
        assert torch.equal(mean, pipe.vae.encode(clip).latent_dist.mode())
    assert torch.equal(encoder(clip[:, :, 0])[0], encoder(clip[:, :, :1])[0])  # an image is a one-frame clip
    normalised = family.latent_normalisation(model).apply(mean)

    def replace_latents(pipe, step, t, tensors):
        return {"latents": normalised}

    args, _, _ = first_call(pipe.vae.post_quant_conv, lambda: pipe(
        "a cat", num_inference_steps=1, height=64, width=32, num_frames=5, guidance_scale=1.0,
        callback_on_step_end=replace_latents, output_type="pt"))
    assert torch.allclose(args[0], mean, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHES)
def test_denoiser_call_is_the_pipelines(arch, models):
    """The transformer's inputs and output in WanPipeline's first step (two prompts, no CFG) against
    family.predict on the same latents, the cached records padded by the family and sigma = t / 1000:
    the same timesteps (TI2V-5B: one per latent token) and the same prediction."""
    model = models[arch]
    family, pipe = families.for_model(model), quiet_pipeline(model)
    _, kwargs, output = first_call(pipe.transformer, lambda: pipe(
        CAPTIONS[:2], num_inference_steps=2, height=64, width=32, num_frames=5, guidance_scale=1.0,
        generator=torch.Generator().manual_seed(0), output_type="latent"))
    cond = family.conditioning(text_records(model, CAPTIONS[:2])[1], [], ObjectiveParams())
    noisy = kwargs["hidden_states"]
    sigma = pipe.scheduler.timesteps[0].float().expand(2) / 1000
    with torch.no_grad():
        _, ours, predicted = first_call(pipe.transformer, lambda: family.predict(pipe.transformer, noisy, sigma, cond,
                                                                                  torch.float32))
    tokens = 2 * (64 // 32) * (32 // 32) if arch == "wan2.2-5b" else None
    assert kwargs["timestep"].shape == ((2, tokens) if tokens else (2,))
    assert torch.equal(ours["timestep"].float(), kwargs["timestep"].float())
    assert torch.equal(predicted[0], output[0])


@pytest.mark.parametrize("arch, flow_shift", [("wan2.1", 3.0), ("wan2.2-5b", 5.0)])
def test_shift_is_the_schedulers_flow_shift(arch, flow_shift, models):
    """Static shift at the UniPC scheduler's flow_shift, as it shifts the sigmas WanPipeline samples;
    the objective noises 5-D latents per sample and scores them with a loss mask."""
    from diffusers import UniPCMultistepScheduler

    model = models[arch]
    objective = families.for_model(model).objective(model, ObjectiveParams())
    assert (objective.sampling.shift, objective.sampling.shift_value) == ("static", flow_shift)
    u = torch.tensor([0.9, 0.5, 0.1])
    scheduler = UniPCMultistepScheduler.from_pretrained(model, subfolder="scheduler")
    scheduler.set_timesteps(sigmas=u.numpy())  # UniPC shifts the sigmas given (an array, not a list)
    assert torch.allclose(objective.shifted(u, 16), scheduler.sigmas[:-1])
    latents = torch.randn(2, 16, 3, 4, 6, generator=torch.Generator().manual_seed(0))
    noise, t, _ = objective.draw(latents, torch.Generator().manual_seed(1))
    noised = objective.noised(latents, noise, t)
    assert t.shape == (2,) and torch.equal(noised.noisy[1], (1 - t[1]) * latents[1] + t[1] * noise[1])
    mask = torch.zeros(2, 1, 4, 6)
    assert objective.loss(noised.target, torch.zeros_like(noised.target), None, mask) == 0


def test_comfyui_export_loads_in_diffusers_and_comfyui(models, exported_loras):
    """Wan's original names under `diffusion_model.` (blocks.N.self_attn.q, cross_attn.o, ffn.0), the
    scale in lora_B and no `.alpha`: read by WanPipeline's non-diffusers converter and by ComfyUI,
    both applying the trained model."""
    transformer, targets, written = exported_loras("wan2.1")
    keys = keys_of(written[2])
    assert {"diffusion_model.blocks.0.self_attn.q.lora_A.weight", "diffusion_model.blocks.1.cross_attn.o.lora_B.weight",
            "diffusion_model.blocks.1.ffn.0.lora_A.weight"} <= keys and len(keys) == 2 * len(targets)
    assert not any(k.endswith(".alpha") for k in keys)
    assert_means_what_was_trained(transformer, targets, fused_change(quiet_pipeline(models["wan2.1"]), "transformer",
                                                                     written[2]))
    assert_comfyui_applies_the_merged_model(written[2], transformer, families.for_model(models["wan2.1"]))


def test_musubi_export_loads_in_diffusers_and_comfyui(models, exported_loras):
    """musubi-tuner's spelling (`lora_unet_blocks_0_self_attn_q.lora_down.weight`, `.alpha` = scale x
    rank, weights as trained): WanPipeline's musubi converter reads it (it wants every Linear of every
    block: the attention_ff and all_linear presets), and ComfyUI maps every key. Its metadata names
    musubi's network module, as a file musubi-tuner trained does."""
    transformer, targets, written = exported_loras("wan2.1")
    with safe_open(written[1], "pt") as f:
        assert "lora_unet_blocks_0_self_attn_q.alpha" in f.keys()
        assert f.metadata()["ss_network_module"] == "networks.lora_wan"
        assert f.metadata()["ss_base_model_version"] == "wan"
    assert_means_what_was_trained(transformer, targets, fused_change(quiet_pipeline(models["wan2.1"]), "transformer",
                                                                     written[1]))
    assert_comfyui_applies_the_merged_model(written[1], transformer, families.for_model(models["wan2.1"]))
    assert families.for_model(models["wan2.1"]).export_notes(transformer, written) == []


def test_attention_only_exports_say_which_file_diffusers_reads(models, tmp_path):
    """A LoRA on part of each block (no feed-forward): the ComfyUI file loads in diffusers (its converter
    reads what is there), the musubi file does not (that converter wants every Linear of every block, as
    musubi-tuner trains them) and the training log's note names the files to give diffusers instead."""
    family = families.for_model(models["wan2.1"])
    transformer, targets = trained_lora(family, models["wan2.1"], "attention")
    written = family.export_lora(transformer, tmp_path, {}, {})
    assert_means_what_was_trained(transformer, targets, fused_change(quiet_pipeline(models["wan2.1"]), "transformer",
                                                                     written[2]))
    with pytest.raises(KeyError, match="blocks_0_ffn_0.lora_down.weight"):
        quiet_pipeline(models["wan2.1"]).load_lora_weights(written[1])
    assert family.export_notes(transformer, written) == [
        "pytorch_lora_weights_kohya.safetensors loads in ComfyUI and musubi-tuner, not in diffusers, whose loader"
        " reads that spelling only for a LoRA on every Linear of every block (train.target_modules attention_ff or"
        " all_linear): give diffusers pytorch_lora_weights.safetensors or pytorch_lora_weights_comfyui.safetensors"]


@pytest.mark.parametrize("kind", ["dora", "lokr", "loha"])
def test_lycoris_types_are_written_for_comfyui(kind, models, tmp_path):
    """DoRA, LoKr and LoHa in ComfyUI's LyCORIS keys under Wan's original names (one to one with
    diffusers' modules, so a LoKr needs no slice names): ComfyUI reads every key and applies the
    merged model. (That the names are Wan's is checked through diffusers' converter above: ComfyUI's
    model here takes its layout from the same table.)"""
    family = families.for_model(models["wan2.1"])
    transformer = trained_adapter(family, models["wan2.1"], AdapterParams(adapter=kind, rank=2, alpha=3), "all_linear")
    assert_comfyui_applies_the_merged_model(exported_comfyui_file(family, transformer, tmp_path), transformer, family)


@pytest.mark.parametrize("choice", ["high_noise", "low_noise"])
def test_a14b_expert_exports_load_into_their_expert_and_mean_what_was_trained(choice, models, tmp_path):
    """Each expert's files use transformer's names, as the ecosystem loads them: diffusers loads the
    low-noise one with load_into_transformer_2 (the family's load arguments), the other expert is
    left as it was; the diffusers, musubi and ComfyUI files all mean the trained delta."""
    model = models["wan2.2-a14b"]
    family = families.for_model(model).with_denoiser(choice)
    transformer, targets = trained_lora(family, model, "all_linear")
    written = family.export_lora(transformer, tmp_path, {}, {})
    with safe_open(written[0], "pt") as f:
        assert set(f.keys()) == {f"transformer.{t}.lora_{ab}.weight" for t in targets for ab in "AB"}
    other = ({"transformer", "transformer_2"} - {family.components.denoiser}).pop()
    for file in written:
        pipe = quiet_pipeline(model)
        before = {n: p.clone() for n, p in getattr(pipe, other).named_parameters()}
        assert_means_what_was_trained(transformer, targets, fused_change(pipe, family.components.denoiser, file,
                                                                         **dict(family.components.lora_load_kwargs)))
        assert all(torch.equal(p, before[n]) for n, p in getattr(pipe, other).named_parameters())


def test_the_pipeline_renders_with_the_familys_arguments(models):
    """evaluate's render arguments (guidance, negative prompt, text length, the clip's frames: the
    variant's by default, evaluate.num_frames when set and of Wan's 4k+1 form) are WanPipeline's; its
    own UniPC sampler is the one it renders with, and its output read as clips."""
    family = families.for_model(models["wan2.1"])
    kwargs = family.render_kwargs(family.text_settings(models["wan2.1"], TextOptions()), 5.0, "blurry")
    assert kwargs == {"guidance_scale": 5.0, "negative_prompt": "blurry", "max_sequence_length": 512}
    assert family.clip_kwargs(models["wan2.1"], None, 16.0) == {"num_frames": 81}
    assert family.clip_kwargs(models["wan2.1"], 9, 16.0) == {"num_frames": 9}
    with pytest.raises(ValueError, match=r"evaluate.num_frames: Wan takes windows of 4k\+1 frames .*, not 8"):
        family.clip_kwargs(models["wan2.1"], 8, 16.0)
    kwargs |= family.clip_kwargs(models["wan2.1"], None, 16.0)
    pipe = quiet_pipeline(models["wan2.1"])
    family.prepare_pipeline(pipe, family.sampler, None)
    with pytest.raises(ValueError, match="evaluate.scheduler: Wan renders with flow_unipc, not flow_match_euler"):
        family.prepare_pipeline(pipe, "flow_match_euler", None)
    clips = clips_of(pipe(["a cat"], num_inference_steps=2, height=32, width=32, output_type="pil",
                                 generator=[torch.Generator().manual_seed(0)], **{**kwargs, "negative_prompt": ["blurry"]}))
    assert len(clips) == 1 and len(clips[0]) == 81 and clips[0][0].size == (32, 32)
    video = pipe(["a cat"], num_inference_steps=2, height=32, width=32, output_type="pt",
                 generator=[torch.Generator().manual_seed(0)], **{**kwargs, "negative_prompt": ["blurry"]}).frames
    assert video.shape == (1, 81, 3, 32, 32)
