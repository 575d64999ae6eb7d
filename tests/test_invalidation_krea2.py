"""The cache invariants hold for Krea 2, whose text records depend on a setting in model_index.json
(the pipeline's text_encoder_select_layers), which no component folder's digest covers: on the tiny
Krea 2, through the real preprocess and encode stages, with encodes counted by forward hooks on the
VAE encoder and on Qwen3-VL (one row per caption). A caption edit re-encodes one text record; other
select layers re-encode every text record and no latent."""
from __future__ import annotations

import json

import pytest
from test_invalidation_zimage import (assert_caption_edit_encodes_one_text_record_and_no_latent,
                                     assert_every_text_record_and_no_latent_re_encoded, baseline_copy,
                                     encoded_baseline)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def krea2_baseline(tmp_path_factory, krea2_model, demo_images, count_encoder_rows):
    """One encoded Krea 2 set; every test starts from copies of its model and data over its cache."""
    return encoded_baseline(tmp_path_factory.mktemp("krea2-baseline"), krea2_model, demo_images, count_encoder_rows)


def test_krea2_caption_edit_encodes_one_text_record_and_no_latent(krea2_baseline, tmp_path, count_encoder_rows):
    config = baseline_copy(krea2_baseline, tmp_path)
    assert_caption_edit_encodes_one_text_record_and_no_latent(config, tmp_path / "data", count_encoder_rows)


def test_krea2_select_layers_in_model_index_re_encode_text_records_only(krea2_baseline, tmp_path,
                                                                        count_encoder_rows):
    config = baseline_copy(krea2_baseline, tmp_path)
    index = tmp_path / "model" / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "text_encoder_select_layers": [0, 3, 4]}))
    assert_every_text_record_and_no_latent_re_encoded(config, "resolved.text.hidden_layers", count_encoder_rows)
