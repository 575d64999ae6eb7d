"""The SD families reproduce today's stage code number for number (so rewiring the stages onto the
family layer changes no result), and fix `sample` prediction in training.

Each test puts the family's pieces together the way the rewired stage will (`_micro_batch`,
`_denoising_loss` below: generic code around family calls) and compares with what the stage code
computes today: the same records, the same micro-batch from the same generator, the same loss.
When the stages are rewired, the golden-number tests of issue 13 take over from these comparisons.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import stages.families as families
from family_checks import assert_means_what_was_trained, fused_change, respelled_as_kohya, trained_lora
from safetensors import safe_open
from stages.encoded import EncodedData
from stages.families import ObjectiveParams, TextOptions, TimestepSampling
from stages.train.data import BatchPlan, derived_seed, draws_flipped, prepare_micro_batch
from stages.train.params import TrainParams

CAPTIONS = ["a photo of a tabby cat looking to the side", "", "a photo of a rocket on a launch pad"]


def _micro_batch(family, model: Path, data: EncodedData, plan: BatchPlan, params: TrainParams, m: int):
    """Micro-batch m as the rewired train/data.py builds it: generic sampling, family normalisation,
    objective and conditioning, all randomness from the generator of (seed, m, rank)."""
    rng = torch.Generator().manual_seed(derived_seed(params.seed, "batch", m, 0))
    normalise, objective = family.latent_normalisation(model), family.objective(model, _objective_params(params))
    latents, texts, images = [], [], []
    for sample in plan.batch(m, 0):
        flipped = draws_flipped(sample, rng)
        mean, std = (t.float() for t in data.latent(sample, flipped))
        latents.append(normalise.apply(mean + std * torch.randn(mean.shape, generator=rng)))
        dropped = torch.rand((), generator=rng).item() < params.caption_dropout
        texts.append(data.empty_text() if dropped else data.text(sample))
        images.append((sample, flipped))
    clean = torch.stack(latents)
    noised = objective.noised(clean, *objective.draw(clean, rng))
    return noised, family.conditioning(texts, images, _objective_params(params))


def _objective_params(params: TrainParams) -> ObjectiveParams:
    return ObjectiveParams(**params.model_dump(include={"prediction_type", "snr_gamma", "noise_offset"},
                                               exclude_none=True))


@pytest.fixture(scope="module")
def models(tiny_model, encoded, sdxl_model, sdxl_encoded) -> dict[str, tuple[Path, EncodedData]]:
    """Each SD family's tiny model and the demo photos encoded through it by today's encode stage."""
    return {"sd15": (tiny_model, EncodedData(encoded.artifact_dir, encoded.cache_root)),
            "sdxl": (sdxl_model, EncodedData(sdxl_encoded.artifact_dir, sdxl_encoded.cache_root))}


def _loss(family, unet, noised, cond, dtype) -> torch.Tensor:
    """recipe.unet_loss's MSE around the family's denoiser call."""
    per_sample = F.mse_loss(family.predict(unet, noised.noisy, noised.timesteps, cond, dtype), noised.target,
                            reduction="none").mean(dim=(1, 2, 3))
    return per_sample.mean() if noised.weight is None else (per_sample * noised.weight).mean()


@pytest.mark.parametrize("name,settings", [
    ("sd15", dict()),
    ("sd15", dict(prediction_type="v_prediction", snr_gamma=5.0, noise_offset=0.1, caption_dropout=0.5)),
    ("sdxl", dict(snr_gamma=1.0)),  # sdxl_encoded holds mirrored latents: flips are drawn too
])
def test_training_batch_and_loss_are_todays(name, settings, models):
    from diffusers import DDPMScheduler

    from stages.train.recipe import unet_loss

    model, data = models[name]
    family = families.for_model(model)
    params = TrainParams(batch_size=3, seed=11, **settings)
    plan = BatchPlan(data.split("train"), params.seed, params.batch_size, 1)
    scheduler = DDPMScheduler.from_pretrained(model, subfolder="scheduler")  # as recipe._setup_model does
    if params.prediction_type:
        scheduler.register_to_config(prediction_type=params.prediction_type)
    unet = family.load_denoiser(model, torch.float32)
    for m in range(3):
        today = prepare_micro_batch(data, plan, scheduler, params, m, 0)
        noised, cond = _micro_batch(family, model, data, plan, params, m)
        assert torch.equal(noised.noisy, today.noisy) and torch.equal(noised.timesteps, today.timesteps)
        assert torch.equal(noised.target, today.target)
        assert (noised.weight is None) == (today.loss_weight is None)
        assert noised.weight is None or torch.equal(noised.weight, today.loss_weight)
        assert torch.equal(cond["encoder_hidden_states"], today.hidden_states)
        assert {k: v for k, v in cond.items() if k != "encoder_hidden_states"}.keys() == (today.added_cond or {}).keys()
        assert all(torch.equal(cond[k], v) for k, v in (today.added_cond or {}).items())
        with torch.no_grad():
            assert torch.equal(_loss(family, unet, noised, cond, torch.float32),
                               unet_loss(unet, today, torch.device("cpu"), torch.float32))


def test_sample_prediction_trains_against_the_clean_latent(models):
    """Today train scores a `sample`-prediction model against v while evaluate uses x0; the family's
    one objective gives x0 to both, with min-SNR's x0 weight min(snr, gamma)."""
    from diffusers import DDPMScheduler

    from stages.evaluate.losses import _target

    model = models["sd15"][0]
    family = families.for_model(model)
    objective = family.objective(model, ObjectiveParams(prediction_type="sample", snr_gamma=5.0))
    clean = torch.randn(4, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    noise, t = objective.draw(clean, torch.Generator().manual_seed(1))
    noised = objective.noised(clean, noise, t)
    scheduler = DDPMScheduler.from_pretrained(model, subfolder="scheduler")
    scheduler.register_to_config(prediction_type="sample")
    assert torch.equal(noised.target, clean) and torch.equal(noised.target, _target(scheduler, clean, noise, t))
    alpha_bar = scheduler.alphas_cumprod[t]
    assert torch.allclose(noised.weight, torch.clamp(alpha_bar / (1 - alpha_bar), max=5.0))


def _denoising_loss(family, model: Path, params: ObjectiveParams, unet, data: EncodedData, samples, steps: list[int],
                    seed: int) -> dict:
    """evaluate/losses.denoising_loss as the rewired stage computes it: conditioning made once per
    sample and expanded over the timesteps, the one objective's target."""
    from stages.evaluate.losses import fixed_noise

    objective, normalise = family.objective(model, params), family.latent_normalisation(model)
    t = objective.fixed_timesteps(steps)
    total = torch.zeros(len(steps), dtype=torch.float64)
    for sample in samples:
        mean, _ = data.latent(sample)
        clean = normalise.apply(mean.float()).expand(len(steps), *mean.shape)
        noised = objective.noised(clean, fixed_noise(seed, sample.content_id, tuple(clean.shape)), t)
        cond = family.conditioning([data.text(sample)], [(sample, False)], ObjectiveParams())
        cond = {k: v.expand(len(steps), *v.shape[1:]) for k, v in cond.items()}
        with torch.inference_mode():
            pred = family.predict(unet, noised.noisy, noised.timesteps, cond, unet.dtype)
        error = (pred.cpu() - noised.target) ** 2
        total += error.mean(dim=tuple(range(1, error.ndim))).double()
    per_t = total / len(samples)
    return {"overall": per_t.mean().item(), "by_timestep": {str(s): v.item() for s, v in zip(steps, per_t)}}


@pytest.mark.parametrize("name,prediction", [("sd15", None), ("sd15", "v_prediction"), ("sd15", "sample"),
                                             ("sdxl", None)])
def test_evaluate_loss_is_todays(name, prediction, models):
    from diffusers import DDPMScheduler

    from stages.evaluate.losses import denoising_loss

    model, data = models[name]
    family = families.for_model(model)
    unet = family.load_denoiser(model, torch.float32)
    scheduler = DDPMScheduler.from_pretrained(model, subfolder="scheduler")
    params = ObjectiveParams(prediction_type=prediction) if prediction else ObjectiveParams()
    if prediction:
        scheduler.register_to_config(prediction_type=prediction)
    steps, samples = [100, 500, 900], data.split("holdout") + data.split("train")[:2]
    today = denoising_loss(unet, scheduler, data, samples, steps, loss_seed=4)
    assert _denoising_loss(family, model, params, unet, data, samples, steps, 4) == today


@pytest.mark.parametrize("name", ["sd15", "sdxl"])
def test_text_records_are_todays_and_the_pipelines(name, models):
    from diffusers import DiffusionPipeline

    from stages.encode.texts import TextEncoder

    model = models[name][0]
    family = families.for_model(model)
    settings = family.text_settings(model, TextOptions())
    records = family.load_text_encoder(model, settings, torch.float16, "cpu")(CAPTIONS)
    today = TextEncoder(model, name, torch.float16)(CAPTIONS)
    assert [r.keys() for r in records] == [r.keys() for r in today]
    assert all(torch.equal(r[k], t[k]) for r, t in zip(records, today) for k in r)
    pipe = DiffusionPipeline.from_pretrained(model)
    with torch.no_grad():
        encoded = pipe.encode_prompt(CAPTIONS, device="cpu", num_images_per_prompt=1, do_classifier_free_guidance=False)
    assert torch.equal(torch.stack([r["hidden_states"] for r in records]), encoded[0].half())
    if name == "sdxl":  # (prompt_embeds, negative, pooled, negative pooled)
        assert torch.equal(torch.stack([r["pooled"] for r in records]), encoded[2].half())
    with pytest.raises(ValueError, match="encode.max_sequence_length"):
        family.text_settings(model, TextOptions(max_sequence_length=100))


def test_latent_normalisation_is_the_encode_index_scale(models):
    for model, data in models.values():
        normalise = families.for_model(model).latent_normalisation(model)
        assert (normalise.scale, normalise.shift) == (data.index["vae_scaling_factor"], 0.0)


@pytest.mark.parametrize("spec", ["attention", "attention_ff", "all_linear", ("to_q", "conv_in")])
def test_lora_targets_are_todays(spec, tiny_model):
    from stages.train.recipe import resolve_target_modules

    family = families.for_model(tiny_model)
    unet = family.load_denoiser(tiny_model, torch.float32)
    assert family.lora_target_modules(unet, spec) == resolve_target_modules(unet, spec)


def test_exported_files_are_todays_bytes(tiny_model, tmp_path):
    from peft import LoraConfig

    from stages.train.lora_files import write_diffusers_lora, write_kohya_lora

    family = families.for_model(tiny_model)
    unet = family.load_denoiser(tiny_model, torch.float32)
    unet.add_adapter(LoraConfig(r=4, lora_alpha=3.0, target_modules=["to_q", "to_v"], init_lora_weights="gaussian"))
    provenance, kohya = {"lorapipe.steps": "5"}, {"ss_network_dim": "4"}
    written = family.export_lora(unet, tmp_path, provenance, kohya)
    write_diffusers_lora(unet, tmp_path / "today.safetensors", provenance)
    write_kohya_lora(unet, tmp_path / "today_kohya.safetensors", 3.0,
                     {**provenance, **kohya, "ss_base_model_version": "sd_v1"})
    assert written[0].read_bytes() == (tmp_path / "today.safetensors").read_bytes()
    assert written[1].read_bytes() == (tmp_path / "today_kohya.safetensors").read_bytes()


@pytest.mark.parametrize("arch", ["sd15", "sdxl"])
def test_comfyui_export_in_ldm_names_means_what_was_trained(arch, tiny_model, sdxl_model, tmp_path):
    """`diffusion_model.<LDM name>.lora_A/lora_B.weight` + `.alpha` for every Linear of the UNet
    (attention, feed-forward, resnets' emb_layers.1, time_embed, SDXL's label_emb). diffusers' SD
    converter reads LDM names only in kohya's spelling and maps SGM blocks only when given the UNet
    config (StableDiffusionPipeline.load_lora_weights does not pass it; the SDXL one does), so the
    file is respelled and converted by `lora_state_dict(..., unet_config=...)`: every key maps, every
    alpha is the rank (the scale is in lora_B), and the fused change is the trained one."""
    from diffusers import DiffusionPipeline

    model = tiny_model if arch == "sd15" else sdxl_model
    family = families.for_model(model)
    unet, targets = trained_lora(family, model, "all_linear")
    comfy = family.export_lora(unet, tmp_path, {}, {})[2]
    with safe_open(comfy, "pt") as f:
        keys = set(f.keys())
    assert comfy.name == "pytorch_lora_weights_comfyui.safetensors"
    assert {"diffusion_model.input_blocks.1.0.emb_layers.1.lora_A.weight", "diffusion_model.time_embed.0.alpha",
            "diffusion_model.middle_block.1.transformer_blocks.0.attn2.to_k.lora_B.weight"} < keys
    assert ("diffusion_model.label_emb.0.0.lora_A.weight" in keys) == (arch == "sdxl")
    assert len(keys) == 3 * len(targets)
    kohya = respelled_as_kohya(comfy, tmp_path / "respelled.safetensors")
    pipe = DiffusionPipeline.from_pretrained(model)
    converted, alphas = pipe.lora_state_dict(kohya, unet_config=pipe.unet.config)
    assert len(alphas) == len(targets) and set(alphas.values()) == {4.0}
    assert_means_what_was_trained(unet, targets, fused_change(pipe, "unet", converted))


def test_model_parts_and_family_are_todays(models, tmp_path):
    from cache.digest import StatCache
    from flows.plan import MODEL_PARTS
    from stages.models import component_digests, model_family

    with StatCache(tmp_path / "stat.sqlite") as stat_cache:
        for name, (model, _) in models.items():
            family = families.for_model(model)
            assert family.name == model_family(model) == name
            digests = component_digests(model, stat_cache)
            for stage in ("encode", "train", "evaluate"):
                assert set(family.components.for_stage(stage)) == set(digests) & set(MODEL_PARTS[stage])
            assert family.identity(digests) == digests["unet"]
    with pytest.raises(ValueError, match="model.family is sdxl but"):
        families.for_model(models["sd15"][0], "sdxl")


def test_objective_refuses_flow_matching_settings(tiny_model):
    family = families.for_model(tiny_model)
    with pytest.raises(ValueError, match="train.timestep_sampling: applies to flow-matching models"):
        family.objective(tiny_model, ObjectiveParams(timestep_sampling=TimestepSampling(distribution="sigmoid")))
    with pytest.raises(ValueError, match="train.guidance"):
        family.objective(tiny_model, ObjectiveParams(guidance=2.0))


def test_tiny_arches_come_from_the_registry():
    assert set(families.tiny_arches()) == {"sd15", "sdxl", "flux1", "flux1-schnell", "z-image", "z-image-turbo",
                                            "flux2-klein", "flux2-klein-distilled", "qwen-image"}
    with pytest.raises(ValueError, match="unknown arch 'sd3'"):
        families.build_tiny_model(Path("unused"), "sd3")
