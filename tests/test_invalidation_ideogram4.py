"""The cache invariants on the tiny Ideogram 4, whose text records are the pipeline's own pass over
Qwen3-VL's decoder layers: through the real preprocess and encode stages, encodes counted by forward
hooks on its VAE encoder and on Qwen3-VL's first decoder layer (one row per caption). A caption edit
re-encodes one text record; another image under the same name re-encodes one latent; new VAE
weights (their batch-norm statistics too) re-encode latents only."""
from __future__ import annotations

import pytest
from PIL import Image, ImageOps
from test_invalidation import statuses
from test_invalidation_zimage import (assert_caption_edit_encodes_one_text_record_and_no_latent,
                                     assert_new_vae_weights_re_encode_latents_but_no_text, baseline_copy,
                                     encode_counted, encoded_baseline)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, ideogram4_model, demo_images, count_encoder_rows):
    """One encoded Ideogram 4 set; every test starts from copies of its model and data over its cache."""
    return encoded_baseline(tmp_path_factory.mktemp("ideogram4-baseline"), ideogram4_model, demo_images,
                            count_encoder_rows)


def test_caption_edit_encodes_one_text_record_and_no_latent(baseline, tmp_path, count_encoder_rows):
    config = baseline_copy(baseline, tmp_path)
    assert_caption_edit_encodes_one_text_record_and_no_latent(config, tmp_path / "data", count_encoder_rows)


def test_an_image_swapped_under_its_name_encodes_one_latent_and_no_text(baseline, tmp_path, count_encoder_rows):
    config = baseline_copy(baseline, tmp_path)
    photo = tmp_path / "data" / "coffee.jpg"
    with Image.open(photo) as image:
        ImageOps.mirror(image).save(photo, format=image.format)
    results, counts = encode_counted(config, count_encoder_rows)
    assert statuses(results) == {"preprocess": "computed", "encode": "computed"}
    assert counts == {"vae": 1, "text": 0}
    assert results["encode"].info["latents_encoded"] == 1 and results["encode"].info["texts_encoded"] == 0


def test_new_vae_weights_re_encode_latents_but_no_text(baseline, tmp_path, count_encoder_rows):
    config = baseline_copy(baseline, tmp_path)
    assert_new_vae_weights_re_encode_latents_but_no_text(config, tmp_path / "model", count_encoder_rows)
