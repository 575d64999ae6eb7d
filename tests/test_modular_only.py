"""The models diffusers ships only as modular pipelines, on tiny components built offline: FLUX.3's
text-encode, VAE-encode and denoise blocks run on their own, each in a ModularPipeline built from
the block and local components (no hub), so each gives the reference a family's parity checks
compare with (the flux3 family's text records, predict and shift are compared with them here);
LTX-2.5's text blocks (LTX-2's) equal what LTX2Pipeline encodes; MiniMax-H3's text
block reads one hidden layer (docs/families.md, "Models diffusers ships only as modular
pipelines").

FLUX.3's blocks read their components from the tiny FLUX.3 (stages/families/tiny/flux3.py), through
folders.py, as a FLUX.3 folder is read; its text encoder and processor are the tiny Qwen-Image 2.1
ones (a Qwen3-VL, deep enough for the eight hidden layers FLUX.3 reads); the VAE block's comparison reads the tiny
flux2-klein model, whose family the normalisation is compared with."""
from __future__ import annotations

import json

import pytest
import torch
from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep, Flux3VaeEncoderStep
from diffusers.modular_pipelines.flux3.modular_blocks_flux3 import Flux3CoreDenoiseStep
from family_checks import block_pipeline, first_call, quiet_pipeline, tiny_model_fixture

import lorapipe.stages.families as families
from lorapipe.cache.digest import StatCache
from lorapipe.cache.errors import UserError
from lorapipe.stages.families.flux3 import SHIFT, predict_window
from lorapipe.stages.families.flux3_text import Flux3PromptEncoder
from lorapipe.stages.families.folders import component_names, load_component
from lorapipe.stages.families.qwen_text import QwenPromptSettings
from lorapipe.stages.families.tiny.flux3 import TEXT_LAYERS as LAYERS
from lorapipe.stages.families.tiny.flux3 import build_tiny_flux3, tiny_flux3_transformer
from lorapipe.stages.families.tiny.qwen import TEXT_DIM, qwen_tokenizer, seeded
from lorapipe.stages.families.tiny.qwenimage21 import _processor, _text_encoder
from lorapipe.stages.models import component_digests, weights_digest

flux2 = tiny_model_fixture("flux2-klein")
FLUX3_COMPONENTS = ["text_encoder", "tokenizer", "transformer", "vae"]


# The tiny FLUX.3, saved by ModularPipeline.save_pretrained: modular_model_index.json, no
# model_index.json; its components are read through folders.py as any model folder's.
flux3 = tiny_model_fixture("flux3")


@pytest.fixture(scope="module")
def text(flux3):
    return load_component(flux3, "text_encoder"), load_component(flux3, "tokenizer")


def test_text_block_is_hidden_layers_padded_to_the_blocks_multiple(text):
    """The caption's tokens read as the concatenated hidden states of the chosen layers, then pad rows
    up to the block's `pad_multiple` that are not zeros: the transformer takes no text mask, so a record must
    keep the pad rows the block computes (per-batch padding would change the prediction)."""
    encoder, processor = text
    caption = "a red fox in the snow"
    step = Flux3TextEncoderStep()
    embeds = block_pipeline(step, text_encoder=encoder, tokenizer=processor)(
        prompt=caption, text_encoder_out_layers=LAYERS, output="prompt_embeds")
    rendered = processor.apply_chat_template([{"role": "user", "content": caption}], tokenize=False,
                                             add_generation_prompt=True)
    ids = processor.tokenizer(rendered, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        states = encoder(input_ids=ids, output_hidden_states=True).hidden_states
    unpadded = torch.cat([states[k] for k in LAYERS], dim=-1)
    assert embeds.shape == (1, step.pad_multiple, TEXT_DIM * len(LAYERS)) and ids.shape[1] < step.pad_multiple
    assert torch.allclose(embeds[:, :ids.shape[1]], unpadded, atol=1e-5)
    assert embeds[:, ids.shape[1]:].abs().amin(dim=-1).gt(0).all()


def test_flux3_text_records_are_the_text_blocks_embeddings(text, flux3):
    """The FLUX.3 text record of each caption is exactly the text block's embeddings, pad rows
    included, each caption in its own window: a short one in one pad multiple, a long one in two."""
    encoder, processor = text
    settings = QwenPromptSettings(hidden_layers=LAYERS, max_sequence_length=8192, token_window=8192,
                                  pad_to_window=False, keep_padding=True)
    captions = ["a red fox in the snow", " ".join(["a red fox in the snow"] * 7)]
    records = Flux3PromptEncoder(flux3, settings, torch.float32, "cpu")(captions)
    block = block_pipeline(Flux3TextEncoderStep(), text_encoder=encoder, tokenizer=processor)
    for caption, record in zip(captions, records):
        embeds = block(prompt=caption, text_encoder_out_layers=LAYERS, output="prompt_embeds")
        assert torch.equal(record["hidden_states"], embeds[0])
    assert [len(r["hidden_states"]) for r in records] == [80, 160]


def test_vae_block_normalises_as_the_flux2_family(flux2):
    """FLUX.3 encodes with Flux.2's VAE: the block's normalised latents are the flux2 family's record
    after its own normalisation, so the latent records and their parity check carry over."""
    from diffusers import AutoencoderKLFlux2

    family = families.for_model(flux2)
    pixels = torch.rand(2, 3, 64, 48, generator=torch.Generator().manual_seed(3)) * 2 - 1
    mean, _ = family.load_latent_encoder(flux2, "cpu")(pixels)
    latents = block_pipeline(Flux3VaeEncoderStep(), vae=AutoencoderKLFlux2.from_pretrained(flux2 / "vae"))(
        condition_images=[pixels[:1], pixels[1:]], output="image_cond_latents")
    ours = family.latent_normalisation(flux2).apply(mean)
    assert torch.allclose(ours, torch.cat(latents), atol=1e-5)  # the block encodes one image a call, ours the batch


def test_denoise_block_first_call_is_the_reference(text, flux3):
    """The first transformer call of the core denoise block: the given latents packed to tokens, the
    text block's embeddings, the flow time (sigma, not sigma x 1000), and the Euler step of its
    prediction is what the block returns; FLUX.3's predict makes that call, ids included, and
    returns that prediction in the latents' layout."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.guiders import ClassifierFreeGuidance

    encoder, processor = text
    embeds = block_pipeline(Flux3TextEncoderStep(), text_encoder=encoder, tokenizer=processor)(
        prompt="a red fox", text_encoder_out_layers=LAYERS, output="prompt_embeds")
    transformer = load_component(flux3, "transformer")
    pipe = block_pipeline(Flux3CoreDenoiseStep(), transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(),
                          guider=ClassifierFreeGuidance(guidance_scale=1.0))
    latents = torch.randn(1, 32, 4, 3, generator=torch.Generator().manual_seed(5))
    result = {}
    _, kwargs, (prediction,) = first_call(transformer, lambda: result.update(state=pipe(
        prompt_embeds=embeds, latents=latents, height=64, width=48, num_inference_steps=1,
        output=["latents", "timesteps"])))
    tokens = latents.flatten(2).transpose(1, 2)
    assert torch.equal(kwargs["hidden_states"], tokens)
    assert torch.equal(kwargs["encoder_hidden_states"], embeds)
    assert kwargs["timestep"].tolist() == [1.0] and result["state"]["timesteps"].tolist() == [1000.0]
    assert sorted(kwargs) == ["encoder_hidden_states", "hidden_states", "img_ids", "return_dict", "timestep",
                              "txt_ids"]
    stepped = (tokens - prediction).transpose(1, 2).reshape(latents.shape)  # sigma 1 to 0
    assert torch.allclose(result["state"]["latents"], stepped, atol=1e-6)
    ours = {}
    with torch.no_grad():
        _, our_kwargs, _ = first_call(transformer, lambda: ours.update(prediction=predict_window(
            transformer, latents, torch.ones(1), embeds, torch.float32)))
    assert sorted(our_kwargs) == sorted(kwargs)
    assert all(torch.equal(our_kwargs[name], kwargs[name]) for name in kwargs if name != "return_dict")
    assert torch.equal(ours["prediction"], prediction.transpose(1, 2).reshape(latents.shape))


def test_modular_folder_loads_and_keys_as_a_model_folder(flux3, tmp_path):
    """A folder a ModularPipeline saved reads as a model_index.json folder: its components by name,
    each loaded from its subfolder with the saved weights, keyed by the same per-component digests;
    a second build differs only in the folder its index points at."""
    assert not (flux3 / "model_index.json").exists()
    assert component_names(flux3) == FLUX3_COMPONENTS
    loaded, built = load_component(flux3, "transformer"), seeded(tiny_flux3_transformer)
    assert type(loaded) is type(built)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in built.state_dict().items())
    with StatCache(tmp_path / "stat.sqlite") as stat_cache:
        digests = component_digests(flux3, stat_cache, families.get("flux2-klein"))
        assert digests == {name: weights_digest(flux3 / name, stat_cache) for name in FLUX3_COMPONENTS}
    again = build_tiny_flux3(tmp_path / "again")
    index = "modular_model_index.json"
    assert (again / index).read_text() == (flux3 / index).read_text().replace(str(flux3), str(again))
    assert all((again / rel).read_bytes() == (flux3 / rel).read_bytes()
               for rel in (p.relative_to(flux3) for p in flux3.rglob("*") if p.is_file()) if rel.name != index)


@pytest.mark.parametrize("where", [{"pretrained_model_name_or_path": "black-forest-labs/FLUX.3"},
                                   {"pretrained_model_name_or_path": "/elsewhere"},
                                   {"subfolder": "../other"}])
def test_modular_entry_outside_the_folder_is_refused(flux3, tmp_path, where):
    """An entry that would load a component from another repo or folder is refused in one line naming
    the index file and the key: nothing is read from outside the folder the user named."""
    index = json.loads((flux3 / "modular_model_index.json").read_text().replace(str(flux3), str(tmp_path)))
    index["transformer"][2] |= where
    (tmp_path / "modular_model_index.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match=r"modular_model_index.json: transformer loads from .*not from this folder"):
        component_names(tmp_path)


def test_modular_folder_of_no_family_names_its_index(flux3, tmp_path):
    index = json.loads((flux3 / "modular_model_index.json").read_text().replace(str(flux3), str(tmp_path)))
    (tmp_path / "modular_model_index.json").write_text(json.dumps({**index, "_class_name": "MiniModularPipeline"}))
    with pytest.raises(UserError, match=r"modular_model_index.json: unsupported pipeline class 'MiniModularPipeline'"):
        families.for_model(tmp_path)


def test_flux3_family_is_its_modular_index_class_and_predicts_each_window_as_the_block(text, flux3):
    """The flux3 family is found by modular_model_index.json's class; a batch of captions of two windows
    (80 and 160 tokens) is predicted as the core denoise block predicts each caption alone, in its own
    window (the transformer takes no text mask)."""
    family = families.for_model(flux3)
    assert family.name == "flux3" and family.variant.name == "base"
    settings = family.text_settings(flux3, families.TextOptions())
    inputs = {param.name: param.default for param in Flux3TextEncoderStep().inputs}
    assert settings.hidden_layers == inputs["text_encoder_out_layers"]
    assert settings.max_sequence_length == inputs["max_sequence_length"]
    captions = ["a red fox in the snow", " ".join(["a red fox in the snow"] * 7)]
    records = family.text_encoder(flux3, settings, torch.float32, "cpu")(captions)
    assert [len(r["hidden_states"]) for r in records] == [80, 160]
    conditioning = family.conditioning(records, [], families.ObjectiveParams())
    transformer = load_component(flux3, "transformer")
    latents = torch.randn(2, 32, 4, 3, generator=torch.Generator().manual_seed(5))
    sigmas = torch.tensor([0.7, 0.3])
    with torch.no_grad():
        batched = family.predict(transformer, latents, sigmas, conditioning, torch.float32)
        alone = [predict_window(transformer, latents[i:i + 1], sigmas[i:i + 1], r["hidden_states"][None],
                                torch.float32) for i, r in enumerate(records)]
    assert torch.equal(batched, torch.cat(alone))


def test_flux3_objective_shifts_as_the_set_timesteps_block(flux3):
    """No FLUX.3 folder holds a scheduler: the blocks make theirs from a config in their code, with a
    constant shift; the objective's noise levels are that scheduler's sigmas."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.modular_pipelines.flux3.before_denoise import Flux3SetTimestepsStep

    assert not (flux3 / "scheduler").exists()
    spec = next(c for c in Flux3SetTimestepsStep().expected_components if c.name == "scheduler")
    assert dict(spec.config) == {"shift": SHIFT}
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(spec.config)
    u = torch.tensor([0.9, 0.5, 0.1])
    scheduler.set_timesteps(sigmas=u.tolist())
    objective = families.for_model(flux3).objective(flux3, families.ObjectiveParams())
    assert torch.allclose(objective.shifted(u, 12), scheduler.sigmas[:-1])


ltx2 = tiny_model_fixture("ltx2")


def test_ltx25_text_blocks_are_what_ltx2_pipeline_encodes(ltx2):
    """LTX-2.5's text side is LTX-2's blocks (`LTX2TextConditioningStep`, in `LTX25AutoBlocks`):
    Gemma's layers then the connectors, equal to LTX2Pipeline's encode_prompt and connectors, on
    which the ltx2 family's text records rest."""
    from diffusers.modular_pipelines.ltx2.modular_blocks_ltx2 import LTX2TextConditioningStep

    pipe = quiet_pipeline(ltx2)
    blocks = block_pipeline(LTX2TextConditioningStep(), text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer,
                            connectors=pipe.connectors)
    state = blocks(prompt="a red fox", max_sequence_length=32,
                   output=["connector_prompt_embeds", "connector_attention_mask"])
    with torch.no_grad():
        embeds, mask, negative, negative_mask = pipe.encode_prompt("a red fox", max_sequence_length=32,
                                                                   device="cpu")
        video, _, video_mask = pipe.connectors(torch.cat([negative, embeds]), torch.cat([negative_mask, mask]),
                                               padding_side="left")
    assert torch.equal(state["connector_prompt_embeds"], video[1:])
    assert torch.equal(state["connector_attention_mask"], video_mask[1:])


def test_minimax_h3_text_block_is_one_fixed_hidden_layer():
    """MiniMax-H3's text block: the prompt's tokens with no template, unpadded, the hidden state after
    the decoder layer its pipeline fixes (`text_encoder_layer`), so the tiny Qwen3-VL needs one layer
    more than that; a LlavaProcessor stands in for the Qwen3VLProcessor."""
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3TextEncoderStep
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MiniMaxH3ModularPipeline

    layer = MiniMaxH3ModularPipeline.text_encoder_layer.fget(None)
    tokenizer = qwen_tokenizer()
    encoder = seeded(_text_encoder, tokenizer, layers=layer + 1)
    pipe = block_pipeline(MiniMaxH3TextEncoderStep(), text_encoder=encoder, tokenizer=tokenizer,
                          processor=_processor(tokenizer))
    embeds = pipe(prompt="a red fox in the snow", output="prompt_embeds")
    ids = tokenizer("a red fox in the snow", add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = encoder(input_ids=ids, output_hidden_states=True).hidden_states[layer]
    assert torch.allclose(embeds, expected, atol=1e-5)


def test_evaluate_renders_flux3_as_its_modular_pipeline(flux3):
    """Evaluate's pipeline for a modular folder (families/modular.py) is the folder's ModularPipeline
    less the prompt upsampler, called as a DiffusionPipeline: a column of two seeds, at another
    guidance scale than the guider's default, is what that pipeline renders for each seed alone with
    that scale on its guider."""
    import numpy as np

    from lorapipe.stages.evaluate.render import RenderSettings, render_column
    from lorapipe.stages.families.modular import load_render_pipeline

    family = families.for_model(flux3)
    kwargs = family.render_kwargs(family.text_settings(flux3, families.TextOptions()), 2.0, "")
    renderer = load_render_pipeline(flux3, family, None, "cpu")
    column = render_column(renderer, RenderSettings(["a red fox"], [3, 4], 2, 32, 2, kwargs))
    pipe = renderer.pipe
    assert "prompt_upsampler" not in pipe.blocks.sub_blocks and pipe.guider.guidance_scale == 2.0
    for seed, (image,) in zip([3, 4], column):
        (alone,) = pipe(prompt="a red fox", generator=torch.Generator().manual_seed(seed), num_inference_steps=2,
                        height=32, width=32, text_encoder_out_layers=kwargs["text_encoder_out_layers"],
                        output="images")
        assert np.abs(np.asarray(image, dtype=int) - np.asarray(alone, dtype=int)).max() <= 1
