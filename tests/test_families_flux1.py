"""The Flux.1 family against FluxPipeline on the tiny offline Flux: the cached text record is what
inference encodes, the latent normalisation and the denoiser call are the pipeline's, the
flow-matching objective is x_t = (1 - s) x0 + s noise with target noise - x0, and both LoRA exports
load through diffusers' own loaders and mean what was trained (fuse_lora's weight change)."""
from __future__ import annotations

import math

import pytest
import torch
from comfyui_keys import assert_comfyui_applies_the_merged_model, comfyui_unread
from family_checks import assert_builds_byte_identically, assert_loads_key_for_key, assert_means_what_was_trained, \
    fused_change, quiet_pipeline, tiny_model_fixture, trained_lora
from safetensors import safe_open

import lorapipe.stages.families as families
from lorapipe.cache.errors import UserError
from lorapipe.stages.families import ObjectiveParams, TextOptions, TimestepSampling
from lorapipe.stages.families.flux1 import original_names
from lorapipe.stages.lora_formats.diffusers_format import save_safetensors_sorted
from lorapipe.stages.lora_formats.original_names import fused_lora

CAPTIONS = ["a photo of a tabby cat looking to the side", "a photo of a rocket on a launch pad"]


flux_dev, flux_schnell = tiny_model_fixture("flux1"), tiny_model_fixture("flux1-schnell")


def test_tiny_flux_builds_byte_identically_and_loads(flux_dev, tmp_path):
    assert "tokenizer_2/tokenizer.json" in assert_builds_byte_identically(flux_dev, "flux1", tmp_path / "again")
    pipe = quiet_pipeline(flux_dev)
    assert pipe.tokenizer_2.unk_token_id not in pipe.tokenizer_2("A photo, 3 cats!").input_ids


def test_variants_are_told_apart_by_the_model(flux_dev, flux_schnell):
    dev, schnell = families.for_model(flux_dev), families.for_model(flux_schnell)
    assert (dev.name, dev.bound.name, schnell.bound.name) == ("flux1", "dev", "schnell")
    assert dev.text_settings(flux_dev, TextOptions()).max_sequence_length == 512
    assert schnell.text_settings(flux_schnell, TextOptions()).max_sequence_length == 256
    assert schnell.text_settings(flux_schnell, TextOptions(max_sequence_length=64)).max_sequence_length == 64
    with pytest.raises(ValueError, match="encode.max_sequence_length: Flux.1 reads at most 512"):
        dev.text_settings(flux_dev, TextOptions(max_sequence_length=1024))
    assert (dev.variant.render_steps, schnell.variant.render_steps) == (28, 4)
    assert dev.geometry(flux_dev).pixel_multiple == 16
    with pytest.raises(RuntimeError, match="not bound"):
        families.get("flux1").conditioning([], [], ObjectiveParams())


@pytest.mark.parametrize("variant", ["dev", "schnell"])
def test_text_record_is_what_the_pipeline_encodes(variant, flux_dev, flux_schnell):
    model = flux_dev if variant == "dev" else flux_schnell
    family = families.for_model(model)
    settings = family.text_settings(model, TextOptions())
    records = family.text_encoder(model, settings, torch.float32, "cpu")(CAPTIONS)
    with torch.no_grad():  # as FluxPipeline.__call__ runs it
        embeds, pooled, _ = quiet_pipeline(model).encode_prompt(CAPTIONS, max_sequence_length=settings.max_sequence_length)
    for i, record in enumerate(records):
        assert record["hidden_states"].shape == (settings.max_sequence_length, 32)
        assert torch.equal(record["hidden_states"], embeds[i]) and torch.equal(record["pooled"], pooled[i])


def test_latent_normalisation_is_the_pipelines(flux_dev):
    family, pipe = families.for_model(flux_dev), quiet_pipeline(flux_dev)
    pixels = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(3)) * 2 - 1
    mean, std = family.load_latent_encoder(flux_dev, "cpu")(pixels)  # what a latent record holds
    sample = mean + std * torch.randn(mean.shape, generator=torch.Generator().manual_seed(5))
    normalise = family.latent_normalisation(flux_dev)
    assert (normalise.scale, normalise.shift) == (0.3611, 0.1159)
    from diffusers import FluxImg2ImgPipeline

    with torch.no_grad():
        expected = FluxImg2ImgPipeline._encode_vae_image(pipe, pixels, torch.Generator().manual_seed(5))
    assert torch.allclose(normalise.apply(sample), expected, atol=1e-6)


@pytest.mark.parametrize("variant", ["dev", "schnell"])
def test_denoiser_call_is_the_pipelines(variant, flux_dev, flux_schnell):
    """The transformer's inputs and output in FluxPipeline's first step, against family.predict on
    the unpacked latent, the cached text record and sigma: the same prediction."""
    model = flux_dev if variant == "dev" else flux_schnell
    family, pipe = families.for_model(model), quiet_pipeline(model)
    seen = {}

    def hook(module, args, kwargs, output):
        seen.setdefault("kwargs", kwargs)
        seen.setdefault("output", output[0])

    handle = pipe.transformer.register_forward_hook(hook, with_kwargs=True)
    guidance = 3.5 if variant == "dev" else 0.0
    pipe(CAPTIONS[0], num_inference_steps=2, height=64, width=48, guidance_scale=guidance,
         generator=torch.Generator().manual_seed(0), output_type="latent", max_sequence_length=64)
    handle.remove()
    kwargs = seen["kwargs"]
    settings = family.text_settings(model, TextOptions(max_sequence_length=64))
    record = family.text_encoder(model, settings, torch.float32, "cpu")(CAPTIONS[:1])
    params = ObjectiveParams(guidance=guidance) if variant == "dev" else ObjectiveParams()
    cond = family.conditioning(record, [], params)
    assert ("guidance" in cond) == (variant == "dev")
    noisy = pipe._unpack_latents(kwargs["hidden_states"], 64, 48, pipe.vae_scale_factor)
    with torch.no_grad():
        predicted = family.predict(pipe.transformer, noisy, kwargs["timestep"], cond, torch.float32)
    assert noisy.shape == (1, 16, 8, 6)
    assert torch.equal(predicted, pipe._unpack_latents(seen["output"], 64, 48, pipe.vae_scale_factor))


def test_flow_matching_objective(flux_dev, flux_schnell):
    dev = families.for_model(flux_dev)
    objective = dev.objective(flux_dev, ObjectiveParams())
    x0 = torch.randn(3, 16, 8, 8, generator=torch.Generator().manual_seed(1))
    noise, sigmas, _ = objective.draw(x0, torch.Generator().manual_seed(2))
    again = objective.draw(x0, torch.Generator().manual_seed(2))
    assert torch.equal(noise, again[0]) and torch.equal(sigmas, again[1])
    assert sigmas.shape == (3,) and bool(((sigmas > 0) & (sigmas < 1)).all())
    noised = objective.noised(x0, noise, sigmas)
    s = sigmas.view(-1, 1, 1, 1)
    assert torch.allclose(noised.noisy, (1 - s) * x0 + s * noise)
    assert torch.equal(noised.target, noise - x0) and torch.equal(noised.timesteps, sigmas) and noised.weight is None
    assert torch.equal(objective.fixed_timesteps([100, 500]), torch.tensor([0.1, 0.5]))
    with pytest.raises(ValueError, match="loss_timesteps must be below 1000"):
        objective.fixed_timesteps([1000])


def test_timestep_shifts_are_the_schedulers(flux_dev, flux_schnell):
    """Defaults from the scheduler config: dev shifts by resolution (BFL's mu over the image's token
    count, as FluxPipeline samples), schnell statically by its `shift` (1.0)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    u = torch.tensor([0.1, 0.5, 0.9])
    dev = families.for_model(flux_dev).objective(flux_dev, ObjectiveParams())
    assert dev.sampling.shift == "resolution"
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(flux_dev, subfolder="scheduler")
    for side in (8, 128):  # 64 px and 1024 px
        tokens = (side // 2) ** 2
        expected = scheduler.time_shift(calculate_shift(tokens), 1.0, u)
        assert torch.allclose(dev.shifted(u, tokens), expected)
        assert dev.sample_timesteps((1, 16, side, side), torch.Generator().manual_seed(0)).shape == (1,)
    schnell = families.for_model(flux_schnell).objective(flux_schnell, ObjectiveParams())
    assert (schnell.sampling.shift, schnell.sampling.shift_value) == ("static", 1.0)
    assert torch.equal(schnell.shifted(u, 16), u)
    static = families.for_model(flux_dev).objective(
        flux_dev, ObjectiveParams(timestep_sampling=TimestepSampling(shift="static", shift_value=3.0)))
    assert torch.allclose(static.shifted(u, 16), 3 * u / (1 + 2 * u))


def test_timestep_distributions_and_weighting(flux_dev):
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    family = families.for_model(flux_dev)
    plain = TimestepSampling(shift="none")
    draws, samplings = {}, {"uniform": plain, "logit_normal": plain.model_copy(update={"distribution": "logit_normal"}),
                            "sigmoid": plain.model_copy(update={"distribution": "sigmoid", "sigmoid_scale": 2.0})}
    for name, sampling in samplings.items():
        objective = family.objective(flux_dev, ObjectiveParams(timestep_sampling=sampling, loss_weighting="cosmap"))
        draws[name] = objective.sample_timesteps((4000, 16, 8, 8), torch.Generator().manual_seed(0))
    assert abs(draws["uniform"].mean() - 0.5) < 0.02 and abs(draws["uniform"].std() - math.sqrt(1 / 12)) < 0.01
    assert draws["sigmoid"].std() > draws["logit_normal"].std() > 0.1  # a wider logit spreads the levels
    assert abs(torch.logit(draws["logit_normal"]).std() - 1) < 0.05
    sigmas = torch.tensor([0.2, 0.7])
    noised = objective.noised(torch.zeros(2, 16, 2, 2), torch.ones(2, 16, 2, 2), sigmas)
    assert torch.equal(noised.weight, compute_loss_weighting_for_sd3("cosmap", sigmas))


def test_objective_refuses_what_does_not_apply(flux_dev, flux_schnell):
    dev, schnell = families.for_model(flux_dev), families.for_model(flux_schnell)
    with pytest.raises(ValueError, match="train.snr_gamma: applies to DDPM models"):
        dev.objective(flux_dev, ObjectiveParams(snr_gamma=5.0))
    with pytest.raises(ValueError, match="train.guidance: Flux.1 schnell has no guidance input"):
        schnell.objective(flux_schnell, ObjectiveParams(guidance=3.5))
    with pytest.raises(ValueError, match="evaluate.negative_prompt"):
        dev.render_kwargs(dev.text_settings(flux_dev, TextOptions()), 3.5, "blurry")


def test_explicit_lora_targets_are_taken_as_given(flux_dev):
    family = families.for_model(flux_dev)
    assert family.lora_target_modules(family.load_denoiser(flux_dev, torch.float32), ("to_q",)) == ["to_q"]


def test_every_exported_file_loads_as_written(flux_dev, exported_loras):
    """Every key of the diffusers file lands on a LoRA weight of its value in FluxPipeline, nothing
    unexpected, nothing missing; ComfyUI applies the trained model from the kohya and ComfyUI files.
    (tests/test_families.py: the presets, the diffusers file's keys and that it means what was trained.)"""
    transformer, _, written = exported_loras("flux1")
    family = families.for_model(flux_dev)
    pipe = quiet_pipeline(flux_dev)
    assert_loads_key_for_key(pipe, written[0])
    for file in written[1:]:
        assert_comfyui_applies_the_merged_model(file, transformer, family)
    # ComfyUI maps Flux.1's diffusers names (`transformer.*`) too, but reads no adapter config: it applies
    # the diffusers file at scale 1, not alpha / rank
    assert not comfyui_unread(written[0], transformer, family)


def test_kohya_export_loads_through_diffusers_converter(flux_dev, tmp_path):
    """Double blocks: q/k/v fused into img_attn.qkv and txt_attn.qkv, loaded by FluxPipeline's kohya
    converter. (Single blocks cannot load at this width: diffusers 0.42.1 splits linear1 at Flux.1's
    fixed 3072/12288 rows; the full-width test below covers them.)"""
    family = families.for_model(flux_dev)
    double = tuple(t for t in family.lora_target_modules(family.load_denoiser(flux_dev, torch.float32), "all_linear")
                   if t.startswith("transformer_blocks."))
    transformer, targets = trained_lora(family, flux_dev, double)
    kohya = family.export_lora(transformer, tmp_path, {"lorapipe.steps": "1"}, {"ss_network_alpha": "3.0"})[1]
    with safe_open(kohya, "pt") as f:
        keys, metadata = set(f.keys()), f.metadata()
        qkv_alpha, qkv_down = f.get_tensor("lora_unet_double_blocks_0_img_attn_qkv.alpha"), \
            f.get_tensor("lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight")
    assert metadata["ss_base_model_version"] == "flux1" and metadata["ss_network_alpha"] == "3.0"
    assert {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in keys} == {
        f"lora_unet_double_blocks_0_{m}" for m in ("img_attn_qkv", "img_attn_proj", "img_mlp_0", "img_mlp_2",
                                                   "img_mod_lin", "txt_attn_qkv", "txt_attn_proj", "txt_mlp_0",
                                                   "txt_mlp_2", "txt_mod_lin")}
    assert qkv_down.shape[0] == 12 and qkv_alpha.item() == pytest.approx(3.0 / 4 * 12)  # rank 3 x 4, scale kept
    assert_means_what_was_trained(transformer, targets, fused_change(quiet_pipeline(flux_dev), "transformer", kohya))


def test_comfyui_export_loads_through_diffusers_converter(flux_dev, tmp_path):
    """BFL names under `diffusion_model.` spelt `lora_down`/`lora_up` (the only spelling of such files
    diffusers' Flux.1 loader converts; ComfyUI reads it too) with the scale in the up weight and no
    `.alpha`: FluxPipeline.load_lora_weights reads the file as it is, every key maps and the fused
    change is the trained one. Double blocks only, as for the kohya file (linear1's fixed widths)."""
    family = families.for_model(flux_dev)
    double = tuple(t for t in family.lora_target_modules(family.load_denoiser(flux_dev, torch.float32), "all_linear")
                   if t.startswith("transformer_blocks."))
    transformer, targets = trained_lora(family, flux_dev, double)
    comfy = family.export_lora(transformer, tmp_path, {}, {})[2]
    with safe_open(comfy, "pt") as f:
        keys = set(f.keys())
        down = f.get_tensor("diffusion_model.double_blocks.0.img_attn.qkv.lora_down.weight")
    assert down.shape[0] == 12 and not any(k.endswith(".alpha") for k in keys)
    assert_means_what_was_trained(transformer, targets, fused_change(quiet_pipeline(flux_dev), "transformer", comfy))


def test_kohya_export_at_full_width_through_diffusers_converter(tmp_path):
    """Flux.1's real widths (3072, single-block linear1 = q|k|v|mlp), one block of each kind, every
    Linear of the blocks: FluxPipeline.lora_state_dict's kohya converter maps every key back, and each
    module's B @ A is the trained one at its scale (compared on random inputs: the full products
    take half a minute on two cores)."""
    from diffusers import FluxPipeline, FluxTransformer2DModel

    with torch.device("meta"):
        meta = FluxTransformer2DModel(num_layers=1, num_single_layers=1, guidance_embeds=True)
    family, generator, rank, alpha = families.get("flux1"), torch.Generator().manual_seed(0), 4, 3.0
    lora = {}
    for name in family.lora_target_modules(meta, "all_linear"):
        module = meta.get_submodule(name)
        lora[f"{name}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=generator)
        lora[f"{name}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=generator)
    tensors = fused_lora(lora, alpha / rank, original_names(1, 1, True))
    assert tensors["lora_unet_single_blocks_0_linear1.lora_up.weight"].shape == (3 * 3072 + 12288, 4 * rank)
    save_safetensors_sorted(tensors, {}, tmp_path / "kohya.safetensors")
    converted, alphas = FluxPipeline.lora_state_dict(tmp_path / "kohya.safetensors", return_alphas=True)
    modules = {k.rsplit(".", 2)[0] for k in lora}
    assert not alphas and {k.rsplit(".", 2)[0] for k in converted} == {f"transformer.{m}" for m in modules}
    for key in (k for k in lora if k.endswith("lora_A.weight")):
        name = key.rsplit(".", 2)[0]  # block-diagonal ups split back into rank-4 parts (the "sparse" path)
        assert converted[f"transformer.{name}.lora_A.weight"].shape == lora[key].shape, name
        x = torch.randn(lora[key].shape[1], 8, generator=generator)
        got = converted[f"transformer.{name}.lora_B.weight"] @ (converted[f"transformer.{name}.lora_A.weight"] @ x)
        want = lora[f"{name}.lora_B.weight"] @ (lora[key] @ x) * (alpha / rank)
        assert torch.linalg.norm(got - want) <= 1e-5 * torch.linalg.norm(want), name


def test_single_file_flux_is_detected(tmp_path):
    from safetensors.torch import save_file

    save_file({"model.diffusion_model.double_blocks.0.img_attn.qkv.weight": torch.zeros(1)}, tmp_path / "f.safetensors")
    family = families.for_model(tmp_path / "f.safetensors")
    assert family.name == "flux1"
    with pytest.raises(UserError) as alone:  # a transformer file holds no VAE nor text encoders: which keys to set
        families.single_file_folder(family, tmp_path / "f.safetensors", "digest", tmp_path / "models")
    assert str(alone.value) == (f"model.path: {tmp_path / 'f.safetensors'} is a Flux.1 transformer alone, not a whole"
                                " model: set model.path to a Flux.1 base (a diffusers folder or a Hugging Face repo id)"
                                f" and model.transformer: {tmp_path / 'f.safetensors'}")
    save_file({"something.else": torch.zeros(1)}, tmp_path / "g.safetensors")
    with pytest.raises(ValueError, match="none of the tensors that identify"):
        families.for_model(tmp_path / "g.safetensors")
