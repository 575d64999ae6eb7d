"""HunyuanVideo 1.5 image-to-video against HunyuanVideo15ImageToVideoPipeline on the tiny offline model:
the text records are encode_prompt's (as text-to-video's), the conditioning image's record (the image
alone through the VAE, normalised; its SigLIP embedding) is what the pipeline's
prepare_cond_latents_and_mask and encode_image compute from the image, and family.predict with that
record is the pipeline's first transformer call."""
from __future__ import annotations

import numpy
import torch
from family_checks import assert_builds_byte_identically, first_call, quiet_pipeline, text_records, \
    tiny_model_fixture
from PIL import Image

import lorapipe.stages.families as families
from lorapipe.stages.families import ObjectiveParams
from lorapipe.stages.families.base import IMAGE_EMBEDS, REFERENCE_LATENTS

CAPTIONS = ['a sign that says "hello" turns', "a cat turns its head"]  # the first quotes text for ByT5
HEIGHT, WIDTH, FRAMES = 32, 32, 5  # a size of the tiny model's buckets: the pipeline renders at it

model = tiny_model_fixture("hunyuanvideo1.5-i2v")


def test_tiny_hunyuanvideo15_i2v_builds_byte_identically_and_is_told_apart(model, tmp_path):
    files = assert_builds_byte_identically(model, "hunyuanvideo1.5-i2v", tmp_path / "again")
    assert {"image_encoder/model.safetensors", "feature_extractor/preprocessor_config.json"} <= set(files)
    family = families.for_model(model)
    assert (family.name, family.variant.tiny_arch, family.max_references) == \
        ("hunyuanvideo1.5-i2v", "hunyuanvideo1.5-i2v", 1)
    assert (family.image_condition.padded, family.components.image) == (False, ("image_encoder", "feature_extractor"))


def test_text_records_are_encode_prompts(model):
    pipe = quiet_pipeline(model)
    with torch.no_grad():
        embeds, mask, glyphs, glyph_mask = pipe.encode_prompt(CAPTIONS, device="cpu", batch_size=len(CAPTIONS))
    for record, embed, own, glyph, own_glyph in zip(text_records(model, CAPTIONS)[1], embeds, mask.bool(), glyphs,
                                                    glyph_mask.bool()):
        assert torch.equal(record["hidden_states"], embed[own])
        assert torch.equal(record["glyph_states"], glyph[own_glyph])


def test_condition_embedding_and_denoiser_call_are_the_pipelines(model):
    """The pipeline's first (conditional) transformer call on an image: its condition channels are
    our normalised latent of the image alone on the first frame, zeros after, and the first-frame
    mask; its image_embeds are our embedder's; family.predict on its noisy latents is its output."""
    family, pipe = families.for_model(model), quiet_pipeline(model)
    image = Image.fromarray(torch.randint(0, 256, (HEIGHT, WIDTH, 3), generator=torch.Generator().manual_seed(5),
                                          dtype=torch.uint8).numpy())
    _, kwargs, output = first_call(pipe.transformer, lambda: pipe(
        prompt=CAPTIONS[1:], image=image, num_frames=FRAMES, num_inference_steps=2,
        generator=torch.Generator().manual_seed(0), output_type="latent"))
    pixels = torch.from_numpy(numpy.array(image)).permute(2, 0, 1).float() / 127.5 - 1
    reference = family.latent_normalisation(model).apply(family.load_latent_encoder(model, "cpu")(pixels[None])[0])
    channels = reference.shape[1]
    condition = kwargs["hidden_states"][:, channels:]
    assert torch.allclose(condition[:, :channels, :1], reference, atol=1e-5)
    assert (condition[:, :channels, 1:] == 0).all()
    assert (condition[:, channels, 0] == 1).all() and (condition[:, channels, 1:] == 0).all()
    embeds = family.image_condition.embedder(model, family.components.image[0], "cpu")(pixels[None])
    assert torch.equal(embeds, kwargs["image_embeds"])
    cond = family.conditioning(text_records(model, CAPTIONS[1:])[1], [], ObjectiveParams())
    cond[REFERENCE_LATENTS], cond[IMAGE_EMBEDS] = reference.unsqueeze(1), embeds.unsqueeze(1)
    with torch.no_grad():
        _, ours, predicted = first_call(pipe.transformer, lambda: family.predict(
            pipe.transformer, kwargs["hidden_states"][:, :channels], kwargs["timestep"] / 1000, cond, torch.float32))
    assert torch.allclose(ours["hidden_states"], kwargs["hidden_states"], atol=1e-5)
    assert torch.allclose(predicted[0], output[0], atol=1e-5)
