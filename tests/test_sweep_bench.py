"""benchmarks/sweep_bench.py in its smoke mode: a sweep of 2 variants against 2 separate runs, timed
through the real CLI, BENCHMARKS.md left alone."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("on_kept_prefect_server")  # its commands' flows: tests/prefect_server.py

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_smoke_times_the_sweep_and_the_separate_runs(tmp_path):
    before = (REPO / "BENCHMARKS.md").read_bytes()
    done = subprocess.run([sys.executable, "-m", "benchmarks.sweep_bench", "--smoke", "--root", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["variants"] == 2 and len(result["sweep_over_separate"]) == 1
    assert result["sweep_s"][0] > 0 and result["separate_runs_s"][0] > 0
    assert (REPO / "BENCHMARKS.md").read_bytes() == before
    assert sorted(p.name for p in (tmp_path / "sweep" / "out" / "variants").iterdir()) == [
        "learning_rate=0.0005", "learning_rate=0.001"]
