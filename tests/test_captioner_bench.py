"""benchmarks/captioner_bench.py's smoke mode: the same code at tiny sizes, one round. The figures it
prints are there and its counts are right (the bare loop's captions are the stage's; +N images
generate N captions, the rest reused), never its timings; it leaves BENCHMARKS.md alone."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
KINDS = ["qwen2_5_vl", "florence2"]


@pytest.mark.slow
def test_the_captioner_bench_prints_its_figures(tmp_path):
    before = (REPO / "BENCHMARKS.md").read_bytes()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-m", "benchmarks.captioner_bench", "--smoke", "--root", str(tmp_path)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    *throughput, noop = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [row["kind"] for row in throughput] == KINDS
    for row in throughput:
        assert row["same_captions"] is True, row
        assert (row["images"], row["batch_size"], row["max_new_tokens"], row["rounds"]) == (4, 2, 3, 1)
        assert min(row["stage_captions_s"], row["bare_captions_s"], row["ratio"]) > 0
        assert len(row["ratio_per_round"]) == 1 and row["median_ratio"] == row["ratio_per_round"][0]
    assert (noop["images"], noop["images_added"], noop["added_generated"], noop["added_reused"]) == (6, 2, 2, 6)
    for name in ("decision_without_caption_s", "decision_with_caption_s", "with_over_without",
                 "caption_first_build_s", "added_decision_s", "added_preprocess_s", "added_caption_s"):
        assert noop[name] >= 0, name
    review = noop["review"]
    assert review["pages"] == 1 and 0 < review["largest_page_bytes"] == review["all_pages_bytes"]
    assert min(review["one_page_bytes"], review["md_bytes"]) > 0
    assert (REPO / "BENCHMARKS.md").read_bytes() == before
