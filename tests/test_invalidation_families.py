"""The cache invariants for the families with variable-length text records (Z-Image, Krea 2, Qwen-Image
2.1, Ideogram 4, HunyuanVideo 1.5, ERNIE-Image, HunyuanImage 2.1, Kandinsky 5 image and video, FLUX.3)
and for Flux.2-dev, Chroma, HiDream-I1 and LTX-2.5 (a modular folder), a row each: on the family's
tiny model, through the real preprocess and encode stages, with encodes counted by forward hooks
on the VAE encoder and on the text encoder (Qwen3; Qwen3-VL at its first decoder layer: one row per
caption; Mistral3: Flux.2-dev's and ERNIE-Image's; HiDream-I1: TEXT_ROWS; Gemma 3: LTX-2.5's). A
caption edit re-encodes one text record; new VAE weights (Ideogram 4's batch-norm statistics too)
re-encode latents only; what shapes a family's text records (TEXT_CHANGES: a file of the model, a
setting in model_index.json, the family's own data, the token window, the Llama layers a transformer
reads) re-encodes text records only."""
from __future__ import annotations

import json

import pytest
from invalidation_checks import (TEXT_ROWS, assert_caption_edit_encodes_one_text_record_and_no_latent,
                                 assert_every_text_record_and_no_latent_re_encoded,
                                 assert_new_vae_weights_re_encode_latents_but_no_text, baseline_copy, encode_counted)
from PIL import Image, ImageOps
from test_invalidation import statuses

from lorapipe.stages.families.hunyuanimage21 import HunyuanImage21
from lorapipe.stages.families.zimage import ZImage

pytestmark = pytest.mark.slow

FAMILIES = ("z-image", "krea2", "qwen-image-2.1", "ideogram4", "flux2-dev", "hunyuanvideo1.5", "ernie-image", "hunyuanimage2.1",
            "chroma", "hidream-i1", "kandinsky5",
            "kandinsky5-video", "flux3", "ltx2.5")


@pytest.mark.parametrize("arch", FAMILIES)
def test_caption_edit_encodes_one_text_record_and_no_latent(arch, encoded_baselines, tmp_path, count_encoder_rows):
    config = baseline_copy(encoded_baselines(arch), tmp_path)
    assert_caption_edit_encodes_one_text_record_and_no_latent(config, tmp_path / "data", count_encoder_rows,
                                                              TEXT_ROWS.get(arch, 1))


@pytest.mark.parametrize("arch", FAMILIES)
def test_new_vae_weights_re_encode_latents_but_no_text(arch, encoded_baselines, tmp_path, count_encoder_rows):
    config = baseline_copy(encoded_baselines(arch), tmp_path)
    assert_new_vae_weights_re_encode_latents_but_no_text(config, tmp_path / "model", count_encoder_rows)


def chat_template(baseline, tmp_path, monkeypatch):
    """The chat template, a file of the tokenizer folder (Z-Image's tokenizer, Flux.2-dev's processor)."""
    config = baseline_copy(baseline, tmp_path)
    template = tmp_path / "model" / "tokenizer" / "chat_template.jinja"
    template.write_text("{{- '<|im_start|>system\\nDraw it.<|im_end|>\\n' }}" + template.read_text())
    return config


def family_release(family_class, **update):
    """A change of what a family's text settings hold as its own data, not a user setting: a lorapipe
    release that changes it (simulated by patching the family's text settings)."""
    def released_with_update(baseline, tmp_path, monkeypatch):
        released = family_class.text_settings
        monkeypatch.setattr(family_class, "text_settings", lambda self, model_path, options: released(
            self, model_path, options).model_copy(update=update))
        return baseline_copy(baseline, tmp_path)

    return released_with_update


hidden_layer = family_release(ZImage, hidden_layers=(-3,))  # the hidden layer Z-Image reads
template = family_release(HunyuanImage21, template="Draw: {}")  # the template HunyuanImage 2.1 writes captions into


def token_window(baseline, tmp_path, monkeypatch):
    return baseline_copy(baseline, tmp_path, encode={"max_sequence_length": 64})


def select_layers(baseline, tmp_path, monkeypatch):
    """Krea 2's text_encoder_select_layers, a setting in model_index.json that no component folder's
    digest covers."""
    config = baseline_copy(baseline, tmp_path)
    index = tmp_path / "model" / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "text_encoder_select_layers": [0, 3, 4]}))
    return config


def processor_tokenizer(baseline, tmp_path, monkeypatch):
    """Qwen-Image 2.1 reads the tokenizer of the pipeline's processor folder."""
    config = baseline_copy(baseline, tmp_path)
    tokenizer_config = tmp_path / "model" / "processor" / "tokenizer_config.json"
    tokenizer_config.write_text(json.dumps({**json.loads(tokenizer_config.read_text()), "model_max_length": 4096}))
    return config


def llama_layers(baseline, tmp_path, monkeypatch):
    """The Llama layers HiDream-I1's transformer reads, in its config: a denoiser setting that shapes
    the text records."""
    config = baseline_copy(baseline, tmp_path)
    transformer = tmp_path / "model" / "transformer" / "config.json"
    transformer.write_text(json.dumps({**json.loads(transformer.read_text()), "llama_layers": [0, 1, 1, 1]}))
    return config


TEXT_CHANGES = [  # (arch, the change, what status names as the reason)
    pytest.param("z-image", chat_template, "models.tokenizer", id="z-image-chat_template"),
    pytest.param("z-image", hidden_layer, "resolved.text.hidden_layers", id="z-image-hidden_layer"),
    pytest.param("z-image", token_window, "params.max_sequence_length", id="z-image-max_sequence_length"),
    pytest.param("flux2-dev", chat_template, "models.tokenizer", id="flux2-dev-chat_template"),
    pytest.param("krea2", select_layers, "resolved.text.hidden_layers", id="krea2-select_layers_in_model_index"),
    pytest.param("qwen-image-2.1", processor_tokenizer, "models.processor", id="qwen-image-2.1-processor_tokenizer"),
    pytest.param("hunyuanvideo1.5", token_window, "params.max_sequence_length",
                 id="hunyuanvideo1.5-max_sequence_length"),
    pytest.param("ernie-image", token_window, "params.max_sequence_length", id="ernie-image-max_sequence_length"),
    pytest.param("hunyuanimage2.1", template, "resolved.text.template", id="hunyuanimage2.1-template"),
    pytest.param("chroma", token_window, "params.max_sequence_length", id="chroma-max_sequence_length"),
    pytest.param("hidream-i1", llama_layers, "resolved.text.llama_layers", id="hidream-i1-llama_layers"),
    pytest.param("kandinsky5", token_window, "params.max_sequence_length", id="kandinsky5-max_sequence_length"),
    pytest.param("kandinsky5-video", token_window, "params.max_sequence_length",
                 id="kandinsky5-video-max_sequence_length"),
    pytest.param("flux3", token_window, "params.max_sequence_length", id="flux3-max_sequence_length"),
]


@pytest.mark.parametrize("arch, change, reason", TEXT_CHANGES)
def test_what_shapes_text_records_re_encodes_text_records_only(arch, change, reason, encoded_baselines, tmp_path,
                                                               count_encoder_rows, monkeypatch):
    config = change(encoded_baselines(arch), tmp_path, monkeypatch)
    assert_every_text_record_and_no_latent_re_encoded(config, reason, count_encoder_rows, TEXT_ROWS.get(arch, 1))


def test_an_ideogram4_image_swapped_under_its_name_encodes_one_latent_and_no_text(encoded_baselines, tmp_path,
                                                                                  count_encoder_rows):
    config = baseline_copy(encoded_baselines("ideogram4"), tmp_path)
    photo = tmp_path / "data" / "coffee.jpg"
    with Image.open(photo) as image:
        ImageOps.mirror(image).save(photo, format=image.format)
    results, counts = encode_counted(config, count_encoder_rows)
    assert statuses(results) == {"preprocess": "computed", "encode": "computed"}
    assert counts == {"vae": 1, "text": 0}
    assert results["encode"].info["latents_encoded"] == 1 and results["encode"].info["texts_encoded"] == 0
