"""A whole `lorapipe run` killed during training (every process of it, as a crash would) publishes
nothing for train; the next run serves the earlier stages from the cache and resumes training
from the last checkpoint instead of starting over."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from flows.config import load_config
from flows.plan import STAGES, Context
from flows.runner import run_stage

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent


def test_a_run_killed_mid_training_publishes_nothing_and_the_rerun_resumes(tmp_path, tiny_model, demo_images):
    shutil.copytree(demo_images, tmp_path / "data")
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump({
        "name": "crash", "cache_dir": "cache", "output_dir": "out", "model": {"path": str(tiny_model)},
        "data": {"path": "data"}, "preprocess": {"resolution": 64, "holdout_fraction": 0.25},
        "encode": {"num_workers": 0},
        "train": {"max_steps": 150, "checkpoint_every": 10, "keep_checkpoints": 2, "learning_rate": 1e-3},
        "evaluate": {"prompts": ["a photo of a cat"], "seeds": [0], "num_inference_steps": 2},
    }))
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home")}
    run = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", str(config_path)], cwd=REPO, env=env,
                           start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoints = tmp_path / "cache" / "work" / "train"
    deadline = time.time() + 600
    while max((int(p.name[5:]) for p in checkpoints.glob("*/checkpoints/step-*")), default=0) < 20:
        assert run.poll() is None, "the run ended before it could be killed"
        assert time.time() < deadline, "training never wrote its second checkpoint"
        time.sleep(0.2)
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    assert not (tmp_path / "cache" / "train").exists() or not any((tmp_path / "cache" / "train").iterdir())

    config = load_config(config_path)
    ctx = Context(config, log=lambda m: None)
    upstream, results = {}, {}
    for stage in STAGES[:3]:
        results[stage], upstream[stage] = run_stage(ctx, stage, upstream)
    ctx.close()
    assert [results[s].status for s in STAGES[:3]] == ["hit", "hit", "computed"]
    assert results["train"].info["resumed_from"] >= 20
    assert results["train"].info["steps"] == 150
