"""The cache invariants hold for a 2026 family with variable-length text records: on the tiny Z-Image,
through the real preprocess and encode stages, with encodes counted by forward hooks on the VAE
encoder and on Qwen3 (one row per caption). A caption edit re-encodes one text record; what shapes a
text record (the chat template in the tokenizer folder, the hidden layer the family reads, the
token window) re-encodes text records only; new VAE weights re-encode latents only."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_invalidation import make_config, run_all, statuses

from lorapipe.flows.plan import STAGES, Context
from lorapipe.flows.runner import explain
from lorapipe.stages.families.zimage import ZImage

pytestmark = pytest.mark.slow

IMAGES, CAPTIONS = 8, 8 + 1  # the demo photos; their captions and the empty prompt
ENCODE = STAGES[:2]


@pytest.fixture(scope="module")
def zimage_baseline(tmp_path_factory, zimage_model, demo_images, count_encoder_rows):
    """One encoded Z-Image set; every test starts from copies of its model and data over its cache."""
    return encoded_baseline(tmp_path_factory.mktemp("zimage-baseline"), zimage_model, demo_images, count_encoder_rows)


def encoded_baseline(root: Path, model: Path, demo_images: Path, count_encoder_rows) -> Path:
    """The demo photos encoded by `model` (copied, with the data, into root), every encode counted."""
    shutil.copytree(model, root / "model")
    shutil.copytree(demo_images, root / "data")
    with count_encoder_rows() as counts:
        results = run_all(make_config(root, root / "model", root / "data", root / "cache"), ENCODE)
    assert statuses(results) == {"preprocess": "computed", "encode": "computed"}
    assert counts == {"vae": IMAGES, "text": CAPTIONS}
    return root


def baseline_copy(baseline: Path, tmp_path: Path, **sections):
    shutil.copytree(baseline / "model", tmp_path / "model")
    shutil.copytree(baseline / "data", tmp_path / "data")
    return make_config(tmp_path, tmp_path / "model", tmp_path / "data", baseline / "cache", **sections)


def encode_counted(config, count_encoder_rows) -> tuple[dict, dict]:
    with count_encoder_rows() as counts:
        results = run_all(config, ENCODE)
    return results, counts


def encode_row(config) -> dict:
    return next(r for r in explain(Context(config), STAGES) if r["stage"] == "encode")


def assert_every_text_record_and_no_latent_re_encoded(config, reason: str, count_encoder_rows) -> None:
    """status names `reason` for the encode miss; the run re-encodes every caption and no image."""
    row = encode_row(config)
    assert row["status"] == "miss" and reason in row["reason"]
    results, counts = encode_counted(config, count_encoder_rows)
    assert statuses(results) == {"preprocess": "hit", "encode": "computed"}
    assert counts == {"vae": 0, "text": CAPTIONS}
    assert results["encode"].info["latents_encoded"] == 0


def assert_caption_edit_encodes_one_text_record_and_no_latent(config, data: Path, count_encoder_rows) -> None:
    (data / "coffee.txt").write_text("a photo of an espresso\n")
    results, counts = encode_counted(config, count_encoder_rows)
    assert statuses(results) == {"preprocess": "computed", "encode": "computed"}
    assert counts == {"vae": 0, "text": 1}
    assert results["encode"].info["texts_encoded"] == 1 and results["encode"].info["latents_encoded"] == 0


def assert_new_vae_weights_re_encode_latents_but_no_text(config, model: Path, count_encoder_rows) -> None:
    from safetensors.torch import load_file, save_file

    weights = model / "vae" / "diffusion_pytorch_model.safetensors"
    tensors = {k: v * 1.01 if v.is_floating_point() else v for k, v in load_file(weights).items()}
    save_file(tensors, weights, metadata={"format": "pt"})
    row = encode_row(config)
    assert row["status"] == "miss" and "models.vae" in row["reason"]
    results, counts = encode_counted(config, count_encoder_rows)
    assert statuses(results) == {"preprocess": "hit", "encode": "computed"}
    assert counts == {"vae": IMAGES, "text": 0}
    assert results["encode"].info["texts_encoded"] == 0


def test_zimage_caption_edit_encodes_one_text_record_and_no_latent(zimage_baseline, tmp_path, count_encoder_rows):
    config = baseline_copy(zimage_baseline, tmp_path)
    assert_caption_edit_encodes_one_text_record_and_no_latent(config, tmp_path / "data", count_encoder_rows)


def test_zimage_chat_template_change_re_encodes_text_records_only(zimage_baseline, tmp_path, count_encoder_rows):
    config = baseline_copy(zimage_baseline, tmp_path)
    template = tmp_path / "model" / "tokenizer" / "chat_template.jinja"
    template.write_text("{{- '<|im_start|>system\\nDraw it.<|im_end|>\\n' }}" + template.read_text())
    assert_every_text_record_and_no_latent_re_encoded(config, "models.tokenizer", count_encoder_rows)


def test_zimage_hidden_layer_change_re_encodes_text_records_only(zimage_baseline, tmp_path, count_encoder_rows,
                                                                  monkeypatch):
    """The hidden layer is the family's data, not a user setting: a lorapipe release that changes it
    (simulated by patching the family's text settings) must re-encode every text record, no latent."""
    released = ZImage.text_settings
    monkeypatch.setattr(ZImage, "text_settings", lambda self, model_path, options: released(
        self, model_path, options).model_copy(update={"hidden_layers": (-3,)}))
    config = baseline_copy(zimage_baseline, tmp_path)
    assert_every_text_record_and_no_latent_re_encoded(config, "resolved.text.hidden_layers", count_encoder_rows)


def test_zimage_max_sequence_length_re_encodes_text_records_only(zimage_baseline, tmp_path, count_encoder_rows):
    config = baseline_copy(zimage_baseline, tmp_path, encode={"max_sequence_length": 64})
    assert_every_text_record_and_no_latent_re_encoded(config, "params.max_sequence_length", count_encoder_rows)


def test_zimage_new_vae_weights_re_encode_latents_but_no_text(zimage_baseline, tmp_path, count_encoder_rows):
    config = baseline_copy(zimage_baseline, tmp_path)
    assert_new_vae_weights_re_encode_latents_but_no_text(config, tmp_path / "model", count_encoder_rows)
