"""A no-op rerun through the real CLI without a kept Prefect server, at two dataset sizes: wall
time of the second `lorapipe run` (every stage cached: served without a Prefect flow, see
flows/cached_run.py; the first run goes through Prefect's temporary server), and the part of it
spent deciding (the stages' own seconds in run-summary.json) — the rest is Python start-up and
imports. Needs prefect (unlike the other benchmarks); skipped where it is not installed."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .common import pipeline_config

REPO = Path(__file__).resolve().parent.parent


def _run(config: Path, env: dict) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "lorapipe.flows.cli", "run", str(config)], cwd=REPO, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def measure(root: Path, sizes=(1000, 10000)) -> list[dict] | str:
    if importlib.util.find_spec("prefect") is None:
        return "skipped: prefect is not installed"
    rows = []
    for n in sizes:
        train = {"max_steps": 2, "batch_size": 2, "checkpoint_every": 2}
        config = pipeline_config(root, f"pipeline-{n}", n, train, evaluate={"prompts": ["x"], "num_inference_steps": 1})
        work = config.parent
        env = {**os.environ, "PREFECT_HOME": str(work / "prefect-home")}
        first = _run(config, env)
        second = _run(config, env)
        stages = json.loads((work / "out" / "run-summary.json").read_text())["stages"]
        assert [s["status"] for s in stages] == ["hit"] * 4, stages
        rows.append({"images": n, "first_run_s": round(first, 1), "noop_rerun_s": round(second, 1),
                     "deciding_s": round(sum(s["seconds"] for s in stages), 3)})
    return rows
