"""Data safety through the flow layer (keys, stages, the CLI): a run never reads a file that a link
leads to outside the dataset, a refusal that leaves the samples unchanged retrains nothing, and
`lorapipe run --strict` stops at the first bad metadata row with one line.
(tests/test_preprocess.py tests the rules themselves on the preprocess stage alone.)"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from blake3 import blake3
from PIL import Image

from lorapipe.flows.config import validate_config
from lorapipe.flows.steps import Context
from lorapipe.flows.runner import run_stage

pytestmark = pytest.mark.slow

STAGES = ("preprocess", "encode", "train")


def config(tmp_path: Path, model: Path) -> dict:
    return {"name": "safety", "cache_dir": str(tmp_path / "cache"), "output_dir": str(tmp_path / "out"),
            "model": {"path": str(model)}, "data": {"path": str(tmp_path / "data")},
            "preprocess": {"resolution": 64, "holdout_fraction": 0.25}, "encode": {"num_workers": 0},
            "train": {"max_steps": 2, "checkpoint_every": 2, "batch_size": 2}, "evaluate": {"prompts": ["x"]}}


def run_stages(raw: dict) -> dict[str, str]:
    ctx = Context(validate_config(raw, "test"), log=lambda m: None)
    upstream, statuses = {}, {}
    try:
        for stage in STAGES:
            result, upstream[stage] = run_stage(ctx, stage, upstream)
            statuses[stage] = result.status
    finally:
        ctx.close()
    return statuses


def files_holding(root: Path, text: str) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and text.encode() in p.read_bytes()]


def test_a_run_never_reads_a_linked_outside_file_and_a_refusal_alone_retrains_nothing(
        tmp_path, tiny_model, demo_images, count_encoder_rows):
    shutil.copytree(demo_images, tmp_path / "data")
    outside = tmp_path / "outside"
    (outside / "folder").mkdir(parents=True)
    Image.new("RGB", (64, 64), (1, 2, 3)).save(outside / "secret.png")
    Image.new("RGB", (64, 64), (4, 5, 6)).save(outside / "folder" / "inner.png")
    secrets = [blake3((outside / name).read_bytes()).hexdigest() for name in ("secret.png", "folder/inner.png")]
    (tmp_path / "data" / "secret.png").symlink_to(outside / "secret.png")
    (tmp_path / "data" / "secret.txt").write_text("a link leading outside")
    raw = config(tmp_path, tiny_model)
    assert run_stages(raw) == dict.fromkeys(STAGES, "computed")
    report = json.loads(next((tmp_path / "cache" / "preprocess").glob("*/report.json")).read_text())
    assert [(r["path"], r["reason"]) for r in report["rejected"]] == [("secret.png", "outside_dataset")]

    (tmp_path / "data" / "folder").symlink_to(outside / "folder")  # more refusals, the same samples
    (tmp_path / "data" / "metadata.jsonl").write_text(json.dumps({"file_name": "gone.png", "text": "x"}))
    with count_encoder_rows() as counts:
        statuses = run_stages(raw)
    assert statuses == {"preprocess": "computed", "encode": "computed", "train": "hit"}
    assert counts == {"vae": 0, "text": 0}
    for root in (tmp_path / "cache", tmp_path / "out"):
        assert all(not files_holding(root, digest) for digest in secrets)


def test_strict_run_stops_at_the_first_bad_metadata_row_in_one_line(tmp_path, tiny_model, demo_images):
    shutil.copytree(demo_images, tmp_path / "data")
    (tmp_path / "data" / "metadata.jsonl").write_text(
        "\n".join(json.dumps({"file_name": name, "text": "x"}) for name in ("coffee.jpg", "gone.jpg")))
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config(tmp_path, tiny_model)))
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home")}
    done = subprocess.run([sys.executable, "-m", "lorapipe.flows.cli", "run", "c.yaml", "--only", "preprocess", "--strict"],
                          cwd=tmp_path, env=env, text=True, capture_output=True, timeout=600)
    assert done.returncode == 1  # the error is one line (Prefect's server may log after it)
    error = next(line for line in done.stderr.splitlines() if line.startswith("lorapipe: error:"))
    assert error.startswith(f"lorapipe: error: {tmp_path / 'data' / 'metadata.jsonl'}:2: listed_but_missing:"
                            " file_name 'gone.jpg'") and error.endswith("to leave bad rows out")


def test_a_table_row_naming_an_image_outside_the_dataset_is_refused_not_read(tmp_path):
    """hf / parquet tables may store image paths instead of bytes: a path leading outside the
    dataset folder (absolute, `../`, or through a link) is refused as `outside_dataset`."""
    from lorapipe.stages.preprocess.listing import OutsideDataset, named_inside
    from lorapipe.stages.preprocess.sources import Candidate
    from lorapipe.stages.preprocess.validation import Rejected, inspect_image

    data, outside = tmp_path / "table", tmp_path / "secret.png"
    (data / "images").mkdir(parents=True)
    Image.new("RGB", (64, 64)).save(outside)
    Image.new("RGB", (64, 64)).save(data / "images" / "in.png")
    (data / "images" / "link.png").symlink_to(outside)
    assert named_inside(data, "images/in.png", follow_symlinks=False) == data / "images" / "in.png"
    for name in (str(outside), "../secret.png", "images/link.png"):
        with pytest.raises(OutsideDataset, match="outside the dataset folder"):
            named_inside(data, name, follow_symlinks=False)
    assert named_inside(data, "images/link.png", follow_symlinks=True).read_bytes() == outside.read_bytes()

    def read_row():
        return named_inside(data, str(outside), follow_symlinks=False).open("rb")

    row = Candidate(0, "row-0", "row-0", "a caption", "", read_row, lambda: "")
    with pytest.raises(Rejected) as refused:
        inspect_image(row, min_side=8)
    assert refused.value.reason == "outside_dataset"
