"""Whole `lorapipe run` processes at once (issue 12, items 7 and 9): two runs forced together rebuild
train once and both succeed; a training process killed by a signal is retried by Prefect and the
retry resumes from the last checkpoint. Preprocess and encode are cached beforehand (in-process)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from lorapipe.flows.steps import STAGES

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("on_kept_prefect_server")]
REPO = Path(__file__).resolve().parent.parent
TRAINING = "lorapipe.stages.processes.jobs"  # in the command line of the training process (and of a launcher's)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_config, run_stages) -> Path:
    """A config whose preprocess and encode are cached."""
    root = tmp_path_factory.mktemp("concurrent")
    run_stages(tiny_config(root, "race", max_steps=16, checkpoint_every=4, keep_checkpoints=2, log_every=4),
               STAGES[:2])
    return root


def lorapipe_run(workspace: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PREFECT_HOME": str(workspace / "prefect-home")}
    return subprocess.Popen([sys.executable, "-m", "lorapipe.flows.cli", "run", str(workspace / "config.yaml"), "--json",
                             *args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def training_processes(run: subprocess.Popen, timeout: float = 300) -> list[psutil.Process]:
    """The run's training process, once it has started (`lorapipe run` starts it ahead of its job:
    suspended, it holds the training that the stage hands it)."""
    deadline = time.time() + timeout
    while True:
        assert run.poll() is None, run.communicate()[1][-3000:]
        assert time.time() < deadline, "training never started"
        found = [p for p in psutil.Process(run.pid).children(recursive=True) if TRAINING in " ".join(p.cmdline())]
        if found:
            return found
        time.sleep(0.05)


def finished(run: subprocess.Popen) -> dict:
    out, err = run.communicate(timeout=600)
    assert run.returncode == 0, err[-3000:]
    return {row["stage"]: row for row in json.loads(out)["stages"]}


def test_two_runs_forcing_train_at_once_both_succeed_and_train_once(workspace):
    first = lorapipe_run(workspace, "--set", "train.seed=1", "--only", "train", "--force", "train")
    paused = training_processes(first)
    for process in paused:  # hold the first run mid-training until the second reaches train
        process.suspend()
    for line in first.stderr:  # the process was started ahead: wait until the first run's stage holds train
        if "train: 1 process(es)" in line:
            break
    second = lorapipe_run(workspace, "--set", "train.seed=1", "--only", "train", "--force", "train")
    try:
        for line in second.stderr:
            if "Task run 'train" in line:
                break
    finally:
        for process in paused:
            process.resume()
    trained, reused = finished(first)["train"], finished(second)["train"]
    assert trained["status"] == "computed" and reused["status"] == "hit"
    assert reused["reason"].startswith("built meanwhile by a concurrent run") and reused["key"] == trained["key"]
    verify = subprocess.run([sys.executable, "-m", "lorapipe.flows.cli", "cache", "verify", "--config",
                             str(workspace / "config.yaml")], cwd=REPO, capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout


def test_a_training_process_killed_by_a_signal_is_retried_and_resumes(workspace):
    earlier = set((workspace / "cache" / "work" / "train").glob("*"))
    run = lorapipe_run(workspace, "--set", "train.seed=2", "--only", "train")
    worker = max(training_processes(run), key=lambda p: p.create_time())
    deadline = time.time() + 300
    while not [w for w in (workspace / "cache" / "work" / "train").glob("*")
               if w not in earlier and (w / "checkpoints" / "step-000004").is_dir()]:
        assert worker.is_running() and time.time() < deadline, "no checkpoint at step 4"
        time.sleep(0.05)
    worker.send_signal(signal.SIGKILL)  # as the OOM killer would
    out, err = run.communicate(timeout=600)
    assert run.returncode == 0, err[-3000:]
    train = {row["stage"]: row for row in json.loads(out)["stages"]}["train"]
    assert train["status"] == "computed" and train["info"]["steps"] == 16 and train["info"]["resumed_from"] >= 4
    log = Path(json.loads(out)["log"]).read_text()
    assert "Retry 1/2" in log and "WorkerCrashed" in log
