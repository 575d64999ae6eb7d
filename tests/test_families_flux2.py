"""The Flux.2-klein family against Flux2KleinPipeline on the tiny offline Klein: the cached text
record (three Qwen3 layers, every position) is what inference encodes, the patched batch-norm
normalisation and the denoiser call are the pipeline's, the shift is the pipeline's empirical mu,
the distilled checkpoint is known as such, and the three LoRA exports load through diffusers' own
loaders and mean what was trained."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from comfyui_keys import assert_comfyui_applies_the_merged_model
from family_checks import CAPTIONS, assert_builds_byte_identically, assert_means_what_was_trained, first_call, \
    fused_change, quiet_pipeline, tiny_model_fixture
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

import lorapipe.stages.families as families
from lorapipe.cache.errors import UserError
from lorapipe.stages.families import ObjectiveParams, TextOptions, TimestepSampling
from lorapipe.stages.families.base import REFERENCE_LATENTS


base, distilled = tiny_model_fixture("flux2-klein"), tiny_model_fixture("flux2-klein-distilled")


def test_tiny_klein_builds_byte_identically_and_loads(base, tmp_path):
    assert "vae/diffusion_pytorch_model.safetensors" in assert_builds_byte_identically(base, "flux2-klein",
                                                                                          tmp_path / "again")
    pipe = quiet_pipeline(base)
    text = pipe.tokenizer.apply_chat_template([{"role": "user", "content": "A cat!"}], tokenize=False,
                                              add_generation_prompt=True, enable_thinking=False)
    assert text == "<|im_start|>user\nA cat!<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_variants_are_told_apart_by_the_model_index(base, distilled):
    b, d = families.for_model(base), families.for_model(distilled)
    assert (b.name, b.bound.name, d.bound.name) == ("flux2-klein", "base", "distilled")
    assert d.variant.train_instead.startswith("black-forest-labs/FLUX.2-klein-base-4B")
    assert b.variant.train_instead is None
    assert (b.variant.render_steps, d.variant.render_steps) == (50, 4)
    assert b.geometry(base).pixel_multiple == 16
    settings = b.text_settings(base, TextOptions(max_sequence_length=64))
    assert (settings.hidden_layers, settings.max_sequence_length, settings.keep_padding) == ((9, 18, 27), 64, True)
    assert b.render_kwargs(settings, 4.0, "")["text_encoder_out_layers"] == (9, 18, 27)
    with pytest.raises(ValueError, match="train.guidance: Flux.2-klein base has no guidance input"):
        b.objective(base, ObjectiveParams(guidance=3.0))


def test_text_records_are_what_the_pipeline_encodes(base):
    family = families.for_model(base)
    settings = family.text_settings(base, TextOptions())
    records = family.text_encoder(base, settings, torch.float32, "cpu")(CAPTIONS)
    with torch.no_grad():
        embeds, _ = quiet_pipeline(base).encode_prompt(list(CAPTIONS), max_sequence_length=512)
    for i, record in enumerate(records):
        assert record["hidden_states"].shape == (512, 48)
        assert torch.equal(record["hidden_states"], embeds[i])
    assert torch.equal(family.conditioning(records, [], ObjectiveParams())["encoder_hidden_states"], embeds)


def test_latent_normalisation_is_the_pipelines(base):
    """The VAE's batch-norm statistics after a 2x2 patchify, as Flux2KleinPipeline encodes images."""
    family, pipe = families.for_model(base), quiet_pipeline(base)
    pixels = torch.rand(2, 3, 64, 48, generator=torch.Generator().manual_seed(3)) * 2 - 1
    mean, _ = family.load_latent_encoder(base, "cpu")(pixels)
    normalise = family.latent_normalisation(base)
    assert normalise.kind == "patched_batch_norm" and len(normalise.running_mean) == 32
    with torch.no_grad():
        expected = pipe._encode_vae_image(pixels, torch.Generator().manual_seed(0))  # the posterior's mode
    assert mean.shape == (2, 8, 8, 6) and expected.shape == (2, 32, 4, 3)
    assert torch.allclose(normalise.apply(mean), expected, atol=1e-6)
    from lorapipe.stages.families.latents import normalisation_from_json

    assert normalisation_from_json(normalise.model_dump()) == normalise  # as the encode index records it


@pytest.mark.parametrize("variant", ["base", "distilled"])
def test_denoiser_call_is_the_pipelines(variant, base, distilled):
    model = base if variant == "base" else distilled
    family, pipe = families.for_model(model), quiet_pipeline(model)
    _, kwargs, output = first_call(pipe.transformer, lambda: pipe(
        prompt=CAPTIONS[:2], num_inference_steps=2, height=64, width=48, guidance_scale=1.0, max_sequence_length=64,
        generator=torch.Generator().manual_seed(0), output_type="latent"))
    settings = family.text_settings(model, TextOptions(max_sequence_length=64))
    records = family.text_encoder(model, settings, torch.float32, "cpu")(CAPTIONS[:2])
    cond = family.conditioning(records, [], ObjectiveParams())
    assert kwargs["guidance"] is None
    noisy = pipe._unpack_latents_with_ids(kwargs["hidden_states"], kwargs["img_ids"], 4, 3)
    with torch.no_grad():
        predicted = family.predict(pipe.transformer, noisy, pipe.scheduler.sigmas[0].expand(2), cond, torch.float32)
    assert noisy.shape == (2, 32, 4, 3)
    assert torch.equal(predicted, pipe._unpack_latents_with_ids(output[0], kwargs["img_ids"], 4, 3))


def reference_images(count: int, width: int = 64, height: int = 80) -> list[Image.Image]:
    generator = torch.Generator().manual_seed(count)
    return [Image.fromarray(torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8).numpy())
            for _ in range(count)]


def reference_latents(family, model: Path, images: list[Image.Image]) -> torch.Tensor:
    """(K, C, h, w): the images' normalised posterior means, as encode records them and training reads them."""
    pixels = torch.stack([torch.from_numpy(np.array(image)).permute(2, 0, 1) for image in images]).float()
    mean, _ = family.load_latent_encoder(model, "cpu")(pixels / 255 * 2 - 1)
    return family.latent_normalisation(model).apply(mean)


@pytest.mark.parametrize("arch", ["flux2-klein", "flux2-dev"])
@pytest.mark.parametrize("count", [1, 2])
def test_denoiser_call_with_references_is_the_pipelines(count, arch, tiny_models):
    """An edit pair's references, encoded by our VAE at the target's size, are the tokens and ids
    Flux2KleinPipeline(image=...) (Flux2Pipeline's, on Flux.2-dev) appends to the noisy ones, and the
    prediction is its own."""
    from diffusers import Flux2KleinPipeline

    base, unpack = tiny_models(arch), Flux2KleinPipeline._unpack_latents_with_ids  # tokens -> (B, C, h, w)
    family, pipe = families.for_model(base), quiet_pipeline(base)
    images = reference_images(count)
    _, kwargs, output = first_call(pipe.transformer, lambda: pipe(
        prompt=CAPTIONS[:2], num_inference_steps=2, height=80, width=64, guidance_scale=1.0, max_sequence_length=64,
        generator=torch.Generator().manual_seed(0), output_type="latent", **family.reference_render_kwargs(images)))
    settings = family.text_settings(base, TextOptions(max_sequence_length=64))
    cond = family.conditioning(family.text_encoder(base, settings, torch.float32, "cpu")(CAPTIONS[:2]), [],
                               ObjectiveParams())
    references = reference_latents(family, base, images)
    cond[REFERENCE_LATENTS] = references.unsqueeze(0).expand(2, *references.shape)
    tokens = 5 * 4
    noisy = unpack(kwargs["hidden_states"][:, :tokens], kwargs["img_ids"][:, :tokens], 5, 4)
    sigma = pipe.scheduler.sigmas[0].expand(2)
    predicted = []
    with torch.no_grad():
        _, mine, _ = first_call(pipe.transformer, lambda: predicted.append(family.predict(
            pipe.transformer, noisy, sigma, cond, torch.float32)))
        unreferenced = family.predict(pipe.transformer, noisy, sigma, {k: v for k, v in cond.items()
                                                                       if k != REFERENCE_LATENTS}, torch.float32)
    assert kwargs["hidden_states"].shape[1] == tokens * (1 + count)
    assert torch.equal(mine["img_ids"], kwargs["img_ids"])
    assert torch.allclose(mine["hidden_states"], kwargs["hidden_states"], atol=1e-5)
    expected = unpack(output[0][:, :tokens], kwargs["img_ids"][:, :tokens], 5, 4)
    assert predicted[0].shape == (2, 32, 5, 4)
    assert torch.allclose(predicted[0], expected, atol=1e-5)
    assert not torch.allclose(unreferenced, expected, atol=1e-3)


@pytest.mark.parametrize("arch, bound, pipeline", [("flux2-klein", 4, "Flux2KleinPipeline"),
                                                    ("flux2-dev", 10, "Flux2Pipeline")])  # BFL's bounds
def test_references_render_as_the_pipelines_list_up_to_the_bound(arch, bound, pipeline, tiny_models):
    family = families.for_model(tiny_models(arch))
    images = reference_images(2)
    assert family.max_references == bound
    assert family.reference_render_kwargs(images[:1]) == {"image": images[:1]}
    assert family.reference_render_kwargs(images) == {"image": images}
    with pytest.raises(ValueError, match=f"evaluate.resolution: {pipeline} shrinks a reference image"):
        family.reference_render_kwargs(reference_images(1, 1024, 1040))
    families.check_references(family, bound)
    with pytest.raises(UserError, match=f"{family.label} takes at most {bound}"):
        families.check_references(family, bound + 1)


def test_shift_is_the_pipelines_empirical_mu(base, distilled):
    """Flux2KleinPipeline shifts its sigmas by compute_empirical_mu(image tokens, steps) through the
    scheduler's exponential time shift: "model" is that shift at the variant's render steps."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    u = torch.tensor([0.9, 0.5, 0.1])
    for model, steps in ((base, 50), (distilled, 4)):
        objective = families.for_model(model).objective(model, ObjectiveParams())
        assert (objective.sampling.shift, objective.sampling.shift_steps) == ("empirical", steps)
        for tokens in (12, 4096):  # 64 x 48 px and 1024 x 1024 px
            scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(model, subfolder="scheduler")
            scheduler.set_timesteps(sigmas=u.tolist(), mu=compute_empirical_mu(tokens, steps))
            assert torch.allclose(objective.shifted(u, tokens), scheduler.sigmas[:-1])
        assert objective.sample_timesteps((1, 32, 64, 64), torch.Generator().manual_seed(0)).shape == (1,)
    mine = families.for_model(base).objective(
        base, ObjectiveParams(timestep_sampling=TimestepSampling(shift_steps=8)))
    assert mine.sampling.shift_steps == 8


FLUX2_BASE_MODELS = [("flux2-klein", "flux2_klein"), ("flux2-dev", "flux2_dev")]  # arch, ss_base_model_version


@pytest.mark.parametrize("arch, base_model", FLUX2_BASE_MODELS)
def test_kohya_export_loads_through_diffusers_converter(arch, base_model, tiny_models, exported_loras):
    """musubi-tuner's spelling (`lora_unet_double_blocks_0_img_attn_qkv`, single blocks' linear1 and
    linear2), read by the pipeline's kohya-Flux.2 converter (Flux2KleinPipeline's, Flux2Pipeline's):
    every module's change is the trained one (fused q/k/v split back by its sparse path)."""
    transformer, targets, written = exported_loras(arch)
    with safe_open(written[1], "pt") as f:
        modules = {k.rsplit(".", 2)[0] for k in f.keys() if k.endswith(".weight")}
        assert f.metadata()["ss_base_model_version"] == base_model
    assert modules == {f"lora_unet_double_blocks_0_{m}" for m in (
        "img_attn_qkv", "img_attn_proj", "img_mlp_0", "img_mlp_2", "txt_attn_qkv", "txt_attn_proj", "txt_mlp_0",
        "txt_mlp_2")} | {"lora_unet_single_blocks_0_linear1", "lora_unet_single_blocks_0_linear2"}
    model = tiny_models(arch)
    assert_means_what_was_trained(transformer, targets, fused_change(quiet_pipeline(model), "transformer", written[1]))


@pytest.mark.parametrize("arch", [arch for arch, _ in FLUX2_BASE_MODELS])
def test_comfyui_export_loads_in_diffusers_and_comfyui(arch, tiny_models, exported_loras):
    """ComfyUI/ai-toolkit's spelling (`diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight`) with
    the scale in lora_B and no `.alpha`, which the Flux.2 pipelines' ai-toolkit converter refuses:
    load_lora_weights reads the file as it is and the fused change is the trained one; ComfyUI reads
    every key of it and of the kohya file and applies the trained model."""
    model = tiny_models(arch)
    transformer, targets, written = exported_loras(arch)
    tensors = load_file(written[2])
    assert "diffusion_model.single_blocks.0.linear1.lora_A.weight" in tensors
    assert not any(k.endswith(".alpha") for k in tensors)
    assert_means_what_was_trained(transformer, targets, fused_change(quiet_pipeline(model), "transformer", written[2]))
    for file in written[1:]:
        assert_comfyui_applies_the_merged_model(file, transformer, families.for_model(model))


def test_single_file_flux2_is_told_from_flux1(tmp_path):
    """Flux.2 checkpoints carry Flux.1's marker names too; its shared modulation tells them apart."""
    from safetensors.torch import save_file

    prefix = "model.diffusion_model."
    save_file({f"{prefix}double_blocks.0.img_attn.qkv.weight": torch.zeros(1),
               f"{prefix}double_stream_modulation_img.lin.weight": torch.zeros(1)}, tmp_path / "klein.safetensors")
    save_file({f"{prefix}double_blocks.0.img_attn.qkv.weight": torch.zeros(1)}, tmp_path / "flux1.safetensors")
    assert families.for_model(tmp_path / "klein.safetensors").name == "flux2-klein"
    assert families.for_model(tmp_path / "flux1.safetensors").name == "flux1"
