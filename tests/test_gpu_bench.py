"""benchmarks/gpu_bench.py's smoke mode: the GPU benchmark's code on the tiny SD1.5 and SDXL models
on the CPU, so that the script a lent GPU will run is known to work. It prints its figures and
must leave BENCHMARKS.md alone."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
RATES = {
    "encode": ("stage_img_s", "bare_img_s", "ratio"),
    "train steps": ("cached_step_ms", "cached_it_s", "bare_step_ms", "on_the_fly_step_ms", "loader_samples_s",
                    "loader_over_consumption", "cached_over_bare", "on_the_fly_over_cached"),
    "cached step sdpa": ("step_ms", "it_s", "tflop_per_step", "achieved_tflop_s"),
    "cached step classic": ("step_ms", "it_s", "tflop_per_step", "achieved_tflop_s"),
}


def test_smoke_prints_every_figure_for_both_archs_and_leaves_benchmarks_md_alone(tmp_path):
    benchmarks_md = REPO / "BENCHMARKS.md"
    before = benchmarks_md.read_bytes()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, "-m", "benchmarks.gpu_bench", "--smoke", "--root", str(tmp_path)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    printed = [json.loads(line) for line in run.stdout.splitlines() if line.startswith('{"measurement"')]
    figures = {p.pop("measurement"): p for p in printed}
    expected = {f"{arch} {what}" for arch in ("sd15", "sdxl") for what in ("model", *RATES)}
    assert set(figures) == expected
    for arch in ("sd15", "sdxl"):
        for what, keys in RATES.items():
            assert all(figures[f"{arch} {what}"][key] > 0 for key in keys), (arch, what, figures[f"{arch} {what}"])
        assert figures[f"{arch} cached step sdpa"]["mfu"] is None  # no bf16 peak is known for a CPU
        assert "mfu_note" in figures[f"{arch} train steps"]
    assert benchmarks_md.read_bytes() == before
