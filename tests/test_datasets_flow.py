"""Several datasets through the real preprocess and encode steps of the flow layer (no Prefect):
ids and repeats reach samples.json, and a repeats change re-encodes nothing."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from lorapipe.flows.config import validate_config
from lorapipe.flows.steps import Context
from lorapipe.flows.runner import run_stage
from lorapipe.stages.encoded import EncodedData


def config(tmp_path: Path, model: Path, repeats: int):
    return validate_config({
        "name": "two-sets", "cache_dir": tmp_path / "cache", "output_dir": tmp_path / "out", "model": {"path": model},
        "data": {"datasets": [{"path": tmp_path / "photos", "repeats": repeats},
                              {"path": tmp_path / "more", "name": "misc", "caption_ext": ".caption"}]},
        "preprocess": {"resolution": 64, "holdout_fraction": 0}, "encode": {"num_workers": 0},
        "train": {}, "evaluate": {"prompts": ["x"]}}, "test")


def encode_both(cfg):
    ctx = Context(cfg, log=lambda m: None)
    try:
        pre, pre_artifact = run_stage(ctx, "preprocess", {})
        enc, enc_artifact = run_stage(ctx, "encode", {"preprocess": pre_artifact})
    finally:
        ctx.close()
    return pre, enc, enc_artifact


def test_two_datasets_keep_their_ids_and_repeats_and_a_repeats_change_encodes_nothing(
        tmp_path, demo_images, tiny_model, count_encoder_rows):
    shutil.copytree(demo_images, tmp_path / "photos", ignore=shutil.ignore_patterns("r*", "c*"))
    (tmp_path / "more").mkdir()
    for name in ("rocket", "coffee"):
        shutil.copy(demo_images / f"{name}.jpg", tmp_path / "more" / f"{name}.jpg")
        shutil.copy(demo_images / f"{name}.txt", tmp_path / "more" / f"{name}.caption")
    _, _, artifact = encode_both(config(tmp_path, tiny_model, 3))
    samples = EncodedData(artifact.path, tmp_path / "cache").samples
    assert {(s.id, s.dataset, s.repeats) for s in samples if s.dataset == "misc"} == {
        ("misc/coffee", "misc", 1), ("misc/rocket", "misc", 1)}
    assert {s.repeats for s in samples if s.dataset == "photos"} == {3} and len(samples) == 5
    with count_encoder_rows() as counts:
        pre, enc, artifact = encode_both(config(tmp_path, tiny_model, 5))
    assert pre.status == "computed" and "inputs.datasets.photos.repeats" in pre.reason
    assert enc.status == "computed" and counts == {"vae": 0, "text": 0}
    assert {s["repeats"] for s in json.loads((artifact.path / "samples.json").read_text())["samples"]} == {1, 5}
