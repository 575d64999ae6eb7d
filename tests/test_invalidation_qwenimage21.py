"""The cache invariants on the tiny Qwen-Image 2.1, whose text encoder reads the tokenizer of the
pipeline's processor folder: through the real preprocess and encode stages, encodes counted by
forward hooks on its VAE encoder and on Qwen3-VL. A caption edit re-encodes one text record; a
change to the processor's tokenizer re-encodes text records only; new VAE weights re-encode
latents only."""
from __future__ import annotations

import json

import pytest
from test_invalidation_zimage import assert_caption_edit_encodes_one_text_record_and_no_latent, \
    assert_every_text_record_and_no_latent_re_encoded, assert_new_vae_weights_re_encode_latents_but_no_text, \
    encoded_baseline, baseline_copy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, qwenimage21_model, demo_images, count_encoder_rows):
    """One encoded Qwen-Image 2.1 set; every test starts from copies of its model and data over its cache."""
    return encoded_baseline(tmp_path_factory.mktemp("qwenimage21-baseline"), qwenimage21_model, demo_images,
                            count_encoder_rows)


def test_caption_edit_encodes_one_text_record_and_no_latent(baseline, tmp_path, count_encoder_rows):
    config = baseline_copy(baseline, tmp_path)
    assert_caption_edit_encodes_one_text_record_and_no_latent(config, tmp_path / "data", count_encoder_rows)


def test_processor_tokenizer_change_re_encodes_text_records_only(baseline, tmp_path, count_encoder_rows):
    config = baseline_copy(baseline, tmp_path)
    tokenizer_config = tmp_path / "model" / "processor" / "tokenizer_config.json"
    tokenizer_config.write_text(json.dumps({**json.loads(tokenizer_config.read_text()), "model_max_length": 4096}))
    assert_every_text_record_and_no_latent_re_encoded(config, "models.processor", count_encoder_rows)


def test_new_vae_weights_re_encode_latents_but_no_text(baseline, tmp_path, count_encoder_rows):
    config = baseline_copy(baseline, tmp_path)
    assert_new_vae_weights_re_encode_latents_but_no_text(config, tmp_path / "model", count_encoder_rows)
