"""The cache invariants hold for Flux.1 as for SD (tests/test_invalidation.py): on the tiny Flux.1 dev,
through the real stages, with encodes counted by forward hooks on the VAE encoder and on CLIP and T5
(a Flux.1 caption is two text rows: CLIP's pooled output and T5's sequence)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from invalidation_checks import (CAPTIONS, IMAGES, assert_caption_edit_encodes_one_text_record_and_no_latent,
                                 assert_every_text_record_and_no_latent_re_encoded)
from test_invalidation import make_config, run_all, statuses

from lorapipe.flows.steps import STAGES, Context
from lorapipe.flows.runner import explain

pytestmark = pytest.mark.slow

FLUX = {"train": {"max_steps": 4, "checkpoint_every": 2, "log_every": 2}}


@pytest.fixture(scope="module")
def flux_baseline(tmp_path_factory, flux_model, demo_images, count_encoder_rows):
    """One complete Flux.1 run; every test starts from copies of its model and data over its cache."""
    root = tmp_path_factory.mktemp("flux-baseline")
    shutil.copytree(flux_model, root / "model")
    shutil.copytree(demo_images, root / "data")
    config = make_config(root, root / "model", root / "data", root / "cache", **FLUX)
    with count_encoder_rows() as counts:
        encoded = run_all(config, STAGES[:2])
    assert statuses(encoded) == {"preprocess": "computed", "encode": "computed"}
    assert counts == {"vae": IMAGES, "text": 2 * CAPTIONS}
    assert statuses(run_all(config)) == {"preprocess": "hit", "encode": "hit", "train": "computed",
                                         "evaluate": "computed"}
    return root


def flux_copy(baseline: Path, tmp_path: Path, **sections):
    shutil.copytree(baseline / "model", tmp_path / "model")
    shutil.copytree(baseline / "data", tmp_path / "data")
    merged = {k: {**FLUX.get(k, {}), **sections.get(k, {})} for k in {*FLUX, *sections}}
    return make_config(tmp_path, tmp_path / "model", tmp_path / "data", baseline / "cache", **merged)


def test_flux_caption_edit_encodes_one_text_record_and_no_latent(flux_baseline, tmp_path, count_encoder_rows):
    config = flux_copy(flux_baseline, tmp_path)  # CLIP and T5, one caption each:
    assert_caption_edit_encodes_one_text_record_and_no_latent(config, tmp_path / "data", count_encoder_rows, text_rows=2)


def test_flux_timestep_shift_reruns_train_onward_not_encode(flux_baseline, tmp_path, count_encoder_rows):
    shifted = {"timestep_sampling": {"shift": "static", "shift_value": 3.0}}
    config = flux_copy(flux_baseline, tmp_path, train=shifted)
    rows = {r["stage"]: r for r in explain(Context(config), STAGES)}
    assert rows["train"]["status"] == "miss" and "params.timestep_sampling" in rows["train"]["reason"]
    with count_encoder_rows() as counts:
        results = run_all(config, STAGES[:3])
    assert statuses(results) == {"preprocess": "hit", "encode": "hit", "train": "computed"}
    assert counts == {"vae": 0, "text": 0}
    assert rows["evaluate"]["status"] == "miss"  # it reads the new LoRA


def test_flux_max_sequence_length_re_encodes_text_only(flux_baseline, tmp_path, count_encoder_rows):
    config = flux_copy(flux_baseline, tmp_path, encode={"max_sequence_length": 64})
    assert_every_text_record_and_no_latent_re_encoded(config, "params.max_sequence_length", count_encoder_rows,
                                                      text_rows=2)
