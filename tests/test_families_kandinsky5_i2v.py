"""The Kandinsky 5 image-to-video family against Kandinsky5I2VPipeline on the tiny offline model: the
conditioning image's latents are the pipeline's VAE encode of it, and the denoiser call (the image as
the first latent frame, the visual condition's mask on it) is the pipeline's first; the loss leaves
the conditioning frame out."""
from __future__ import annotations

import pytest
import torch
from family_checks import CAPTIONS, first_call, quiet_pipeline, text_records, tiny_model_fixture

import lorapipe.stages.families as families
from lorapipe.stages.families import ObjectiveParams
from lorapipe.stages.families.base import REFERENCE_LATENTS

model = tiny_model_fixture("kandinsky5-i2v")


def test_the_conditioning_image_is_the_pipelines_vae_encode_of_it(model):
    """The image alone through the family's latent encoder, normalised, is the first latent frame
    Kandinsky5I2VPipeline.prepare_latents puts in place of the noise (the posterior sampled with its
    generator, times scaling_factor)."""
    family, pipe = families.for_model(model), quiet_pipeline(model)
    assert (family.name, family.max_references, family.image_condition.padded) == ("kandinsky5-i2v", 1, False)
    image = torch.rand(1, 3, 32, 48, generator=torch.Generator().manual_seed(3))
    mean, std = family.load_latent_encoder(model, "cpu")(image * 2 - 1)
    with torch.no_grad():
        latents = pipe.prepare_latents(image, 1, 16, 32, 48, 5, torch.float32, "cpu", torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(0)
    torch.randn(1, 2, 4, 6, 16, generator=generator)  # the noise the pipeline draws first
    sample = mean + std * torch.randn(mean.shape, generator=generator)
    assert mean.shape == (1, 16, 1, 4, 6) and latents[..., 32].tolist() == [[[[1.0] * 6] * 4, [[0.0] * 6] * 4]]
    expected = latents[:, :1, ..., :16].permute(0, 4, 1, 2, 3)
    assert torch.allclose(family.latent_normalisation(model).apply(sample), expected, atol=1e-6)


def test_denoiser_call_is_the_pipelines_with_the_image_as_the_first_frame(model):
    family, pipe = families.for_model(model), quiet_pipeline(model)
    received = []
    handle = pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: received.append(kwargs["hidden_states"].clone()), with_kwargs=True)
    image = torch.rand(1, 3, 32, 48, generator=torch.Generator().manual_seed(3))
    _, _, output = first_call(pipe.transformer, lambda: pipe(
        image=image, prompt=CAPTIONS[0], num_inference_steps=2, height=32, width=48, num_frames=5,
        guidance_scale=1.0, generator=torch.Generator().manual_seed(0), output_type="latent"))
    handle.remove()
    latents = received[0][..., :16].permute(0, 4, 1, 2, 3)
    noisy = torch.cat([torch.randn_like(latents[:, :, :1]), latents[:, :, 1:]], dim=2)  # the family replaces it
    conditioning = family.conditioning(text_records(model, CAPTIONS[:1])[1], [], ObjectiveParams())
    conditioning[REFERENCE_LATENTS] = latents[:, None, :, :1]
    with torch.no_grad():
        predicted = family.predict(pipe.transformer, noisy, pipe.scheduler.sigmas[0].expand(1), conditioning,
                                   torch.float32)
    assert torch.equal(predicted, output.sample.permute(0, 4, 1, 2, 3))
    scored, _ = family.loss_region(predicted, predicted)
    assert torch.equal(scored, predicted[:, :, 1:])


def test_clips_render_long_enough_for_the_pipelines_first_frame_rescaling(model):
    """Kandinsky5I2VPipeline rescales its first 4 latent frames to those after them: 9 frames (3 latent
    frames) render NaN, a black clip, so evaluate refuses them in one line; 17 (5) render."""
    family, pipe = families.for_model(model), quiet_pipeline(model)
    assert family.clip_kwargs(model, 17, 24) == {"num_frames": 17}
    with pytest.raises(ValueError, match=r"^evaluate.num_frames: Kandinsky 5 I2V renders clips of at least 17 frames"
                                         r" \(.*\), not 13$"):
        family.clip_kwargs(model, 13, 24)
    latents = torch.randn(1, 3, 4, 6, 16, generator=torch.Generator().manual_seed(0))
    assert pipe.normalize_first_frame(latents).isnan().all()  # what 9 frames would render
    assert not pipe.normalize_first_frame(torch.cat([latents, latents[:, :2]], dim=1)).isnan().any()
