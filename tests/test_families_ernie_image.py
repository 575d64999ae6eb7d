"""The ERNIE-Image family against ErnieImagePipeline on the tiny offline ERNIE-Image: the cached text
record (each caption alone, Mistral3's penultimate layer at its own tokens) is what encode_prompt
makes, the normalised latents are what the pipeline turns back into the VAE's before decoding (its
own batch-norm eps), the denoiser call is the pipeline's first, the shift is the scheduler config's,
and the ComfyUI file (diffusers' names under `diffusion_model.`) loads through the pipeline's own
loader, meaning what was trained."""
from __future__ import annotations

import torch
from family_checks import (CAPTIONS, COMFYUI_FILE, assert_builds_byte_identically, assert_means_what_was_trained,
                           assert_shift_is_the_schedulers, first_call, first_step_predicted, fused_change, keys_of,
                           quiet_pipeline, text_records, tiny_model_fixture)

import lorapipe.stages.families as families
from lorapipe.stages.families import ObjectiveParams, TextOptions

ernie = tiny_model_fixture("ernie-image")


def test_tiny_ernie_image_builds_byte_identically_and_is_told_apart(ernie, tmp_path):
    files = assert_builds_byte_identically(ernie, "ernie-image", tmp_path / "again")
    assert "text_encoder/model.safetensors" in files and not any(f.startswith("pe") for f in files)
    family = families.for_model(ernie)
    assert (family.name, family.bound.render_steps, family.bound.render_guidance) == ("ernie-image", 50, 4.0)
    assert family.geometry(ernie).pixel_multiple == quiet_pipeline(ernie).vae_scale_factor == 16
    settings = family.text_settings(ernie, TextOptions())
    assert (settings.hidden_layers, settings.max_sequence_length, settings.keep_padding) == ((-2,), 512, False)
    assert family.render_kwargs(settings, 4.0, "blurry") == {"guidance_scale": 4.0, "negative_prompt": "blurry",
                                                             "use_pe": False}


def test_text_records_are_what_the_pipeline_encodes(ernie):
    """Each record is encode_prompt's hidden states of its caption alone (the bos first: the empty
    caption is one token); padded per batch, the family's mask counts each record's tokens."""
    family, records = text_records(ernie, CAPTIONS)
    with torch.no_grad():
        expected = quiet_pipeline(ernie).encode_prompt(CAPTIONS, device="cpu")
    assert [len(r["hidden_states"]) for r in records][2] == 1 and records[0]["hidden_states"].shape[1] == 16
    for record, embed in zip(records, expected, strict=True):
        assert torch.equal(record["hidden_states"], embed)
    cond = family.conditioning(records, [], ObjectiveParams())
    assert cond["text_mask"].sum(1).tolist() == [len(e) for e in expected]


def test_latent_normalisation_is_what_the_pipeline_inverts(ernie):
    """Our normalised posterior mean, put in as the final latents, is the VAE's latent again at the
    decoder's input: the pipeline's batch-norm denormalisation (eps 1e-5, not the config's 1e-4) and
    unpatchify are its inverse."""
    family, pipe = families.for_model(ernie), quiet_pipeline(ernie)
    pixels = torch.rand(1, 3, 64, 48, generator=torch.Generator().manual_seed(3)) * 2 - 1
    mean, _ = family.load_latent_encoder(ernie, "cpu")(pixels)
    normalised = family.latent_normalisation(ernie).apply(mean)
    assert normalised.shape == (1, 32, 4, 3) and pipe.vae.config.batch_norm_eps == 1e-4
    args, _, _ = first_call(pipe.vae.decoder.conv_in, lambda: pipe(
        "a cat", num_inference_steps=1, height=64, width=48, output_type="pt",
        callback_on_step_end=lambda *_: {"latents": normalised}))
    assert torch.allclose(args[0], mean, atol=1e-6)


def test_denoiser_call_is_the_pipelines(ernie):
    """Two captions of different lengths, without guidance (one conditional batch): the same padded
    text, lengths, timestep and prediction."""
    noisy, predicted, output, kwargs, _ = first_step_predicted(
        ernie, CAPTIONS[:2], lambda pipe, kwargs: kwargs["hidden_states"], height=64, width=48, guidance_scale=1.0)
    assert noisy.shape == (2, 32, 4, 3) and kwargs["text_lens"].tolist()[0] > kwargs["text_lens"].tolist()[1]
    assert torch.allclose(predicted, output[0], atol=1e-6)
    assert_shift_is_the_schedulers(ernie, lambda tokens: None)


def test_comfyui_file_is_diffusers_names_and_loads_through_the_pipeline(ernie, exported_loras):
    transformer, targets, written = exported_loras("ernie-image", "all_linear")
    comfyui = next(p for p in written if p.name == COMFYUI_FILE)
    assert keys_of(comfyui) == {f"diffusion_model.{t}.lora_{ab}.weight" for t in targets for ab in "AB"}
    change = fused_change(quiet_pipeline(ernie), "transformer", comfyui)
    assert_means_what_was_trained(transformer, targets, change)


def test_evaluate_renders_without_loading_the_prompt_enhancer(ernie, tmp_path):
    """A published folder holds the prompt enhancer (a language model as large as the text encoder);
    rendering the captions as trained never calls it, so evaluate's pipeline does not load it."""
    import json

    from conftest import copy_model

    from lorapipe.stages.families.modular import load_render_pipeline

    model = copy_model(ernie, tmp_path / "with-pe")
    index = json.loads((model / "model_index.json").read_text())
    index |= {"pe": ["transformers", "Ministral3ForCausalLM"], "pe_tokenizer": ["transformers", "AutoTokenizer"]}
    (model / "model_index.json").write_text(json.dumps(index))
    (model / "pe").mkdir()  # no weights: loading it would fail
    pipe = load_render_pipeline(model, families.for_model(model), None, "cpu")
    assert pipe.pe is None and pipe.pe_tokenizer is None and pipe.transformer is not None
