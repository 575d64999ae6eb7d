"""The Qwen-Image-Edit and Edit-Plus families against QwenImageEditPipeline and
QwenImageEditPlusPipeline on their tiny offline models: the text record (the instruction read with
the reference images, resized as the pipeline resizes them) is what the pipeline encodes; the
denoiser call with reference latents (the VAE's posterior means, normalised) is the pipeline's own,
the references' tokens after the noisy ones; the LoRA exports load through the edit pipeline's
loader and mean what was trained."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from family_checks import (assert_builds_byte_identically, assert_means_what_was_trained, first_call, fused_change,
                           quiet_pipeline, trained_lora)
from PIL import Image

import lorapipe.stages.families as families
from lorapipe.stages.families import ObjectiveParams, TextOptions
from lorapipe.stages.families.base import REFERENCE_LATENTS

CAPTIONS = ["make the cat blue", "add a rocket to the sky"]
REFERENCES = {"qwen-image-edit": 1, "qwen-image-edit-plus": 2}  # images each test sample has
MAX_REFERENCES = {"qwen-image-edit": 1, "qwen-image-edit-plus": 3}


def photo(seed: int, size: tuple[int, int] = (48, 64)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module", params=list(REFERENCES))
def model(request, tiny_models) -> Path:
    return tiny_models(request.param)


def encoded(family, model: Path, captions: list[str], references: list[list[Image.Image]]):
    encoder = family.text_encoder(model, family.text_settings(model, TextOptions()), torch.float32, "cpu")
    return encoder(captions, references)


def test_tiny_edit_model_builds_byte_identically_and_loads(model, tmp_path):
    family = families.for_model(model)
    files = assert_builds_byte_identically(model, family.variant.tiny_arch, tmp_path / "again")
    assert "processor/processor_config.json" in files
    assert (family.text_takes_references, family.max_references) == (True, MAX_REFERENCES[family.name])
    with pytest.raises(ValueError, match="encode.max_sequence_length: Qwen-Image-Edit.* reads the whole instruction"):
        family.text_settings(model, TextOptions(max_sequence_length=512))
    with pytest.raises(ValueError, match="reads each instruction with its reference image.*'a cat' has none"):
        encoded(family, model, ["a cat"], [[]])


def test_text_records_are_what_encode_prompt_makes_of_the_pipelines_resized_images(model):
    """Each caption with its own references (Plus: two), resized as the pipeline's __call__ resizes
    them before encode_prompt (Edit: 1024 x 1024 area; Plus: 384 x 384), and the template's first 64
    tokens dropped."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

    family, pipe = families.for_model(model), quiet_pipeline(model)
    area = 384 * 384 if family.name.endswith("plus") else 1024 * 1024
    references = [[photo(10 * i + k, (48 + 16 * k, 64)) for k in range(REFERENCES[family.name])]
                  for i in range(len(CAPTIONS))]
    records = encoded(family, model, CAPTIONS, references)
    for caption, images, record in zip(CAPTIONS, references, records):
        resized = [pipe.image_processor.resize(image, *calculate_dimensions(area, image.width / image.height)[::-1])
                   for image in images]
        with torch.no_grad():
            embeds, mask = pipe.encode_prompt(caption, image=resized if len(resized) > 1 else resized[0])
        assert mask is None and torch.equal(record["hidden_states"], embeds[0])


@pytest.mark.slow
def test_denoiser_call_with_references_is_the_pipelines(model, monkeypatch):
    """A one-step pipeline call with the references, caught at its transformer: the family's text
    record and the references' normalised posterior means packed after the noisy latents are its
    inputs, and predict returns its prediction of the noisy tokens. Plus resizes the references for
    its VAE to its module's VAE_IMAGE_SIZE, set here to a small area that is still not the target's:
    at a megapixel the tiny VAE took most of the module's time."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

    family, pipe = families.for_model(model), quiet_pipeline(model)
    vae_area = 1024 * 1024  # Edit's literal
    if family.name.endswith("plus"):
        vae_area = 128 * 96
        monkeypatch.setattr(pipeline_qwenimage_edit_plus, "VAE_IMAGE_SIZE", vae_area)
    references = [photo(k) for k in range(REFERENCES[family.name])]
    _, kwargs, output = first_call(pipe.transformer, lambda: pipe(
        prompt=CAPTIONS[0], num_inference_steps=1, height=64, width=48, true_cfg_scale=1.0,
        generator=torch.Generator().manual_seed(0), output_type="latent",
        **family.reference_render_kwargs(references)))
    width, height = calculate_dimensions(vae_area, 48 / 64)  # the pipeline's VAE images' size
    noisy_shape, *reference_shapes = kwargs["img_shapes"][0]
    assert reference_shapes == [(1, height // 16, width // 16)] * len(references)
    records = encoded(family, model, CAPTIONS[:1], [references])
    cond = family.conditioning(records, [], ObjectiveParams())
    assert torch.equal(cond["encoder_hidden_states"], kwargs["encoder_hidden_states"])

    pixels = torch.cat([pipe.image_processor.preprocess(image, height, width) for image in references])
    mean, _ = family.load_latent_encoder(model, "cpu")(pixels)
    latents = family.latent_normalisation(model).apply(mean).unsqueeze(0)  # (1, K, C, h, w) as training has them
    packed = torch.cat([pipe._pack_latents(latents[:, k], 1, 4, height // 8, width // 8)
                        for k in range(len(references))], dim=1)
    assert torch.allclose(packed, kwargs["hidden_states"][:, 12:], atol=1e-5)

    noisy = pipe._unpack_latents(kwargs["hidden_states"][:, :12], 64, 48, pipe.vae_scale_factor).squeeze(2)
    tokens = kwargs["hidden_states"][:, 12:].unflatten(1, (len(references), -1))
    cond[REFERENCE_LATENTS] = torch.stack([pipe._unpack_latents(t, height, width, pipe.vae_scale_factor).squeeze(2)
                                           for t in tokens.unbind(1)], dim=1)
    with torch.no_grad():
        predicted = family.predict(pipe.transformer, noisy, pipe.scheduler.sigmas[0].expand(1), cond, torch.float32)
    assert noisy_shape == (1, 4, 3) and predicted.shape == (1, 4, 8, 6)
    expected = pipe._unpack_latents(output[0][:, :12], 64, 48, pipe.vae_scale_factor).squeeze(2)
    assert torch.equal(predicted, expected)


def test_references_reach_the_pipeline_as_it_takes_them(model):
    family, images = families.for_model(model), [photo(0), photo(1)]
    if family.name.endswith("plus"):
        assert family.reference_render_kwargs(images) == {"image": images}
        assert family.reference_render_kwargs(images[:1]) == {"image": images[:1]}
    else:
        assert family.reference_render_kwargs(images[:1]) == {"image": images[0]}
    assert family.render_kwargs(family.text_settings(model, TextOptions()), 4.0, "") == {
        "true_cfg_scale": 4.0, "negative_prompt": " "}


def test_lora_exports_load_through_the_edit_pipeline(model, tmp_path):
    family = families.for_model(model)
    transformer, targets = trained_lora(family, model, "all_linear")
    written = family.export_lora(transformer, tmp_path, {}, {})
    assert [p.name for p in written] == ["pytorch_lora_weights.safetensors", "pytorch_lora_weights_comfyui.safetensors"]
    for file in written:
        assert_means_what_was_trained(transformer, targets, fused_change(quiet_pipeline(model), "transformer", file))


def test_a_batch_with_references_predicts_each_pair_as_alone(model):
    """Training's layout: a batch of two pairs, instructions of different lengths (padded with a mask)
    and references at the target's size (B, K, C, h, w); each row is the pair's prediction on its own,
    and the references change it."""
    family = families.for_model(model)
    transformer = family.load_denoiser(model, torch.float32)
    count = REFERENCES[family.name]
    references = [[photo(10 * i + k) for k in range(count)] for i in range(2)]
    records = encoded(family, model, CAPTIONS, references)
    assert records[0]["hidden_states"].shape[0] != records[1]["hidden_states"].shape[0]
    generator = torch.Generator().manual_seed(0)
    noisy, latents = torch.randn(2, 4, 8, 6, generator=generator), torch.randn(2, count, 4, 8, 6, generator=generator)
    timesteps = torch.tensor([0.3, 0.8])

    def predicted(rows: slice, with_references: bool = True) -> torch.Tensor:
        cond = family.conditioning(records[rows], [], ObjectiveParams())
        if with_references:
            cond[REFERENCE_LATENTS] = latents[rows]
        with torch.no_grad():
            return family.predict(transformer, noisy[rows], timesteps[rows], cond, torch.float32)

    batch = predicted(slice(0, 2))
    assert "encoder_hidden_states_mask" in family.conditioning(records, [], ObjectiveParams())
    for i in range(2):
        assert torch.allclose(batch[i:i + 1], predicted(slice(i, i + 1)), atol=1e-5)
    assert not torch.allclose(batch, predicted(slice(0, 2), with_references=False), atol=1e-3)
