"""A whole `lorapipe run` killed during training (every process of it, as a crash would) publishes
nothing for train; the next run serves the earlier stages from the cache and resumes training
from the last checkpoint instead of starting over."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lorapipe.flows.steps import STAGES

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent


def test_a_run_killed_mid_training_publishes_nothing_and_the_rerun_resumes(tmp_path, tiny_config, run_stages):
    config_path = tiny_config(tmp_path, "crash", max_steps=150, checkpoint_every=10, keep_checkpoints=2,
                              learning_rate=1e-3)
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home")}
    run = subprocess.Popen([sys.executable, "-m", "lorapipe.flows.cli", "run", str(config_path)], cwd=REPO, env=env,
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

    results = {stage: result for stage, (result, _) in run_stages(config_path, STAGES[:3]).items()}
    assert [results[s].status for s in STAGES[:3]] == ["hit", "hit", "computed"]
    assert results["train"].info["resumed_from"] >= 20
    assert results["train"].info["steps"] == 150
