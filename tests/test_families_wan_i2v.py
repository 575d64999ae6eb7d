"""Wan image-to-video against WanImageToVideoPipeline on the tiny offline Wan 2.1 I2V, Wan 2.2 I2V A14B
and Wan 2.2 TI2V-5B as an image-to-video pipeline: the condition the training step builds from the
conditioning image's record (the image then zero frames through the VAE, normalised, behind the
first-frame mask; TI2V-5B: the image alone as the first latent frame, its tokens at timestep 0) is
what the pipeline's prepare_latents builds, the record's CLIP-vision embedding (Wan 2.1) is the
pipeline's encode_image, family.predict is the pipeline's transformer call (A14B: its high-noise
expert's, at the first step), and TI2V-5B's loss leaves out the conditioning frame."""
from __future__ import annotations

import numpy
import pytest
import torch
from family_checks import assert_builds_byte_identically, first_call, quiet_pipeline, text_records
from PIL import Image

import lorapipe.stages.families as families
from lorapipe.stages.encode.images import condition_clip
from lorapipe.stages.families import ObjectiveParams
from lorapipe.stages.families.base import IMAGE_EMBEDS, REFERENCE_LATENTS

ARCHES = ("wan2.1-i2v", "wan2.2-i2v-a14b", "wan2.2-5b-i2v")
HEIGHT, WIDTH, FRAMES = 64, 32, 5


@pytest.fixture(scope="module")
def models(tiny_models):
    return {arch: tiny_models(arch) for arch in ARCHES}


@pytest.mark.parametrize("arch", ARCHES)
def test_tiny_wan_i2v_builds_byte_identically_and_is_told_apart(arch, models, tmp_path):
    files = assert_builds_byte_identically(models[arch], arch, tmp_path / "again")
    family = families.for_model(models[arch])
    a14b, wan21 = arch == "wan2.2-i2v-a14b", arch == "wan2.1-i2v"
    assert (family.name, family.variant.tiny_arch, family.max_references) == ("wan-i2v", arch, 1)
    assert ("image_encoder/model.safetensors" in files) == wan21
    assert family.image_condition.padded == (arch != "wan2.2-5b-i2v")
    assert family.components.image == (("image_encoder", "image_processor") if wan21 else ())
    assert (family.bound.boundary_ratio, family.components.denoisers()) == \
        ((0.9, ("transformer", "transformer_2")) if a14b else (None, ("transformer",)))


@pytest.mark.parametrize("arch", ARCHES)
def test_condition_embedding_and_denoiser_call_are_the_pipelines(arch, models):
    """The pipeline's first transformer call on an image (no CFG): its 20 conditioning channels are
    the first-frame mask and the normalised posterior mean of the padded clip our encoder gives, its
    image input is our embedder's (none for A14B), and family.predict on its noisy latents is its
    output."""
    model = models[arch]
    family, pipe = families.for_model(model), quiet_pipeline(model)
    family = family.with_denoiser("high_noise" if family.denoiser_choices else None)
    family.prepare_pipeline(pipe, family.sampler, family.objective(model, ObjectiveParams()))
    image = Image.fromarray(torch.randint(0, 256, (HEIGHT, WIDTH, 3), generator=torch.Generator().manual_seed(5),
                                          dtype=torch.uint8).numpy())
    captions = ["a cat turns its head"]
    _, kwargs, output = first_call(pipe.transformer, lambda: pipe(
        prompt=captions, image=image, height=HEIGHT, width=WIDTH, num_frames=FRAMES, num_inference_steps=2,
        guidance_scale=1.0, generator=torch.Generator().manual_seed(0), output_type="latent"))
    pixels = torch.from_numpy(numpy.array(image)).permute(2, 0, 1).float() / 127.5 - 1
    padded = family.image_condition.padded
    clip = condition_clip(pixels, FRAMES if padded else 1).unsqueeze(0)
    reference = family.latent_normalisation(model).apply(family.load_latent_encoder(model, "cpu")(clip)[0])
    channels = reference.shape[1]
    if padded:
        assert torch.allclose(kwargs["hidden_states"][:, channels + 4:], reference, atol=1e-5)
        assert (kwargs["hidden_states"][:, channels:channels + 4, 0] == 1).all()
        assert (kwargs["hidden_states"][:, channels:channels + 4, 1:] == 0).all()
    else:
        assert torch.allclose(kwargs["hidden_states"][:, :, :1], reference, atol=1e-5)
    cond = family.conditioning(text_records(model, captions)[1], [], ObjectiveParams())
    cond[REFERENCE_LATENTS] = reference.unsqueeze(1)
    if family.image_condition.embedder is None:
        assert kwargs["encoder_hidden_states_image"] is None
    else:
        embeds = family.image_condition.embedder(model, family.components.image[0], "cpu")(pixels.unsqueeze(0))
        assert torch.equal(embeds, kwargs["encoder_hidden_states_image"])
        cond[IMAGE_EMBEDS] = embeds.unsqueeze(1)
    sigma = pipe.scheduler.timesteps[0].float().expand(1) / 1000
    with torch.no_grad():
        _, ours, predicted = first_call(pipe.transformer, lambda: family.predict(
            pipe.transformer, kwargs["hidden_states"][:, :channels], sigma, cond, torch.float32))
    assert torch.equal(ours["timestep"].float(), kwargs["timestep"].float())
    assert torch.allclose(predicted[0], output[0], atol=1e-5)


def test_ti2v_loss_leaves_out_the_conditioning_frame(models):
    family = families.for_model(models["wan2.2-5b-i2v"])
    pred, target = torch.zeros(1, 48, 3, 2, 2), torch.ones(1, 48, 3, 2, 2)
    assert [t.shape[2] for t in family.loss_region(pred, target)] == [2, 2]
    assert [t.shape[2] for t in families.for_model(models["wan2.1-i2v"]).loss_region(pred, target)] == [3, 3]


def test_ti2v_i2v_shares_the_ti2v_models_bytes(models, tiny_models):
    """The image-to-video TI2V-5B is the text-to-video one's folder with another pipeline class."""
    for part in ("text_encoder", "vae", "transformer"):
        ours, theirs = (sorted((p.relative_to(m), p.read_bytes()) for p in (m / part).rglob("*") if p.is_file())
                        for m in (models["wan2.2-5b-i2v"], tiny_models("wan2.2-5b")))
        assert ours == theirs, part
