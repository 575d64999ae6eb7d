"""The SD families against their diffusers pipelines on the tiny models: the cached text record is
what the pipeline encodes, the recorded latent normalisation is the VAE's, the objective's targets
and min-SNR weights, LoRA presets, the ComfyUI export, and which components each stage depends on.
(tests/test_golden.py pins what training and evaluation compute with them.)"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import lorapipe.stages.families as families
from comfyui_keys import assert_comfyui_applies_the_merged_model, comfyui_unread
from family_checks import assert_means_what_was_trained, fused_change, keys_of, respelled_as_kohya, trained_lora
from safetensors import safe_open
from lorapipe.stages.encoded import EncodedData
from lorapipe.stages.families import ObjectiveParams, TextOptions, TimestepSampling

CAPTIONS = ["a photo of a tabby cat looking to the side", "", "a photo of a rocket on a launch pad"]


@pytest.fixture(scope="module")
def models(tiny_model, encoded, sdxl_model, sdxl_encoded) -> dict[str, tuple[Path, EncodedData]]:
    """Each SD family's tiny model and the demo photos encoded through it by the encode stage."""
    return {"sd15": (tiny_model, EncodedData(encoded.artifact_dir, encoded.cache_root)),
            "sdxl": (sdxl_model, EncodedData(sdxl_encoded.artifact_dir, sdxl_encoded.cache_root))}


@pytest.mark.parametrize("prediction,snr_weight", [
    ("epsilon", lambda snr: torch.clamp(snr, max=5.0) / snr),
    ("v_prediction", lambda snr: torch.clamp(snr, max=5.0) / (snr + 1)),
    ("sample", lambda snr: torch.clamp(snr, max=5.0)),
])
def test_the_objective_targets_and_min_snr_weights(prediction, snr_weight, models):
    """One objective for train and evaluate: epsilon's target is the noise, v's the scheduler's
    velocity, sample's the clean latent; min-SNR weights min(snr, gamma) divided by snr (epsilon),
    snr + 1 (v) or nothing (the clean latent)."""
    from diffusers import DDPMScheduler

    model = models["sd15"][0]
    objective = families.for_model(model).objective(model, ObjectiveParams(prediction_type=prediction, snr_gamma=5.0))
    clean = torch.randn(4, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    noise, t, _ = objective.draw(clean, torch.Generator().manual_seed(1))
    noised = objective.noised(clean, noise, t)
    scheduler = DDPMScheduler.from_pretrained(model, subfolder="scheduler")
    assert torch.equal(noised.noisy, scheduler.add_noise(clean, noise, t))
    target = {"epsilon": noise, "v_prediction": scheduler.get_velocity(clean, noise, t), "sample": clean}[prediction]
    assert torch.equal(noised.target, target) and objective.prediction == prediction
    alpha_bar = scheduler.alphas_cumprod[t]
    assert torch.allclose(noised.weight, snr_weight(alpha_bar / (1 - alpha_bar)))


@pytest.mark.parametrize("name", ["sd15", "sdxl"])
def test_text_records_are_the_pipelines(name, models):
    from diffusers import DiffusionPipeline

    model = models[name][0]
    family = families.for_model(model)
    settings = family.text_settings(model, TextOptions())
    records = family.text_encoder(model, settings, torch.float16, "cpu")(CAPTIONS)
    pipe = DiffusionPipeline.from_pretrained(model)
    with torch.no_grad():
        encoded = pipe.encode_prompt(CAPTIONS, device="cpu", num_images_per_prompt=1, do_classifier_free_guidance=False)
    assert torch.equal(torch.stack([r["hidden_states"] for r in records]), encoded[0].half())
    assert ("pooled" in records[0]) == (name == "sdxl")
    if name == "sdxl":  # (prompt_embeds, negative, pooled, negative pooled)
        assert torch.equal(torch.stack([r["pooled"] for r in records]), encoded[2].half())
    with pytest.raises(ValueError, match="encode.max_sequence_length"):
        family.text_settings(model, TextOptions(max_sequence_length=100))


def test_the_recorded_latent_normalisation_is_the_vaes(models):
    for model, data in models.values():
        scale = families.for_model(model).load_latent_encoder(model, "cpu").vae.config.scaling_factor
        assert (data.normalisation.scale, data.normalisation.shift) == (scale, 0.0)


def test_lora_presets(tiny_model):
    family = families.for_model(tiny_model)
    unet = family.load_denoiser(tiny_model, torch.float32)
    assert family.lora_target_modules(unet, "attention") == ["to_q", "to_k", "to_v", "to_out.0"]
    assert family.lora_target_modules(unet, "attention_ff")[-2:] == ["ff.net.0.proj", "ff.net.2"]
    every = family.lora_target_modules(unet, "all_linear")
    assert every == sorted(n for n, m in unet.named_modules() if isinstance(m, torch.nn.Linear))
    assert family.lora_target_modules(unet, ("to_q", "conv_in")) == ["to_q", "conv_in"]


@pytest.mark.parametrize("arch", ["sd15", "sdxl"])
def test_comfyui_export_in_ldm_names_means_what_was_trained(arch, tiny_model, sdxl_model, tmp_path):
    """`diffusion_model.<LDM name>.lora_A/lora_B.weight` for every Linear of the UNet (attention,
    feed-forward, resnets' emb_layers.1, time_embed, SDXL's label_emb), the scale in lora_B and no
    `.alpha`: ComfyUI reads every key, and the kohya file's, and applies the trained model. diffusers'
    SD converter reads LDM names only in kohya's spelling and maps SGM blocks only when given the UNet
    config (StableDiffusionPipeline.load_lora_weights does not pass it; the SDXL one does), so the file
    is respelled and converted by `lora_state_dict(..., unet_config=...)`: every key maps, and the fused
    change is the trained one. ComfyUI leaves the diffusers file's attention projections unread."""
    from diffusers import DiffusionPipeline

    model = tiny_model if arch == "sd15" else sdxl_model
    family = families.for_model(model)
    unet, targets = trained_lora(family, model, "all_linear")
    written = family.export_lora(unet, tmp_path, {}, {})
    comfy = written[2]
    keys = keys_of(comfy)
    assert comfy.name == "pytorch_lora_weights_comfyui.safetensors"
    assert {"diffusion_model.input_blocks.1.0.emb_layers.1.lora_A.weight", "diffusion_model.time_embed.0.lora_B.weight",
            "diffusion_model.middle_block.1.transformer_blocks.0.attn2.to_k.lora_B.weight"} < keys
    assert ("diffusion_model.label_emb.0.0.lora_A.weight" in keys) == (arch == "sdxl")
    assert len(keys) == 2 * len(targets)
    for file in written[1:]:
        assert_comfyui_applies_the_merged_model(file, unet, family)
    with safe_open(written[0], "pt") as f:  # ComfyUI has attention projections only as `...processor.to_q`
        attention = {k for k in f.keys() if re.search(r"\.to_(q|k|v|out\.0)\.lora_", k)}
    assert attention and comfyui_unread(written[0], unet, family) == attention
    kohya = respelled_as_kohya(comfy, tmp_path / "respelled.safetensors")
    pipe = DiffusionPipeline.from_pretrained(model)
    converted, alphas = pipe.lora_state_dict(kohya, unet_config=pipe.unet.config)
    assert not alphas
    assert_means_what_was_trained(unet, targets, fused_change(pipe, "unet", converted))


def test_each_stage_depends_on_the_components_the_family_names(models, tmp_path):
    from lorapipe.cache.digest import StatCache
    from lorapipe.stages.models import component_digests

    parts = {"encode": {"text_encoder", "tokenizer", "vae"}, "train": {"unet", "scheduler"}}
    with StatCache(tmp_path / "stat.sqlite") as stat_cache:
        for name, (model, _) in models.items():
            family = families.for_model(model)
            digests = component_digests(model, stat_cache, family)
            extra = {"text_encoder_2", "tokenizer_2"} if name == "sdxl" else set()
            assert set(family.components.for_stage("encode")) == parts["encode"] | extra
            assert set(family.components.for_stage("train")) == parts["train"]
            assert set(family.components.for_stage("evaluate")) == set(digests) == parts["encode"] | parts["train"] | extra
            assert family.components.identity(digests) == digests["unet"] and family.name == name
    with pytest.raises(ValueError, match="model.family is sdxl but"):
        families.for_model(models["sd15"][0], "sdxl")


def test_a_list_valued_pipeline_setting_is_not_a_component(tiny_model, tmp_path):
    """model_index.json may hold a pipeline's own setting that is a list, as component entries are
    (Krea2Pipeline's text_encoder_select_layers): the model's components stay those it names."""
    import json
    import shutil

    from lorapipe.cache.digest import StatCache
    from lorapipe.stages.models import component_digests

    model = Path(shutil.copytree(tiny_model, tmp_path / "model"))
    index = model / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "text_encoder_select_layers": [1, 2, 4]}))
    with StatCache(tmp_path / "stat.sqlite") as stat_cache:
        assert component_digests(model, stat_cache, families.get("sd15")) == \
            component_digests(tiny_model, stat_cache, families.get("sd15"))


def test_objective_refuses_flow_matching_settings(tiny_model):
    family = families.for_model(tiny_model)
    with pytest.raises(ValueError, match="train.timestep_sampling: applies to flow-matching models"):
        family.objective(tiny_model, ObjectiveParams(timestep_sampling=TimestepSampling(distribution="sigmoid")))
    with pytest.raises(ValueError, match="train.guidance"):
        family.objective(tiny_model, ObjectiveParams(guidance=2.0))
    family.check_objective(ObjectiveParams(guidance=1.0))  # a config passes every field: only a change is refused


def test_tiny_arches_come_from_the_registry():
    assert set(families.tiny_arches()) == {"sd15", "sdxl", "flux1", "flux1-schnell", "flux1-kontext", "z-image",
                                            "z-image-turbo", "flux2-klein", "flux2-klein-distilled", "flux2-dev", "flux3", "qwen-image",
                                            "qwen-image-edit", "qwen-image-edit-plus", "qwen-image-2.1", "krea2",
                                            "krea2-distilled", "ideogram4", "wan2.1", "wan2.2-5b", "wan2.2-a14b", "wan2.1-i2v",
                                            "wan2.2-i2v-a14b", "wan2.2-5b-i2v", "ltx2", "ltx2-i2v", "ltx2.5",
                                            "hunyuanvideo1.5", "hunyuanvideo1.5-i2v", "ernie-image", "hunyuanimage2.1", "chroma",
                                            "hidream-i1", "hidream-i1-dev", "hidream-i1-fast",
                                            "kandinsky5", "kandinsky5-video", "kandinsky5-i2v"}
    with pytest.raises(ValueError, match="unknown arch 'sd3'"):
        families.build_tiny_model(Path("unused"), "sd3")
