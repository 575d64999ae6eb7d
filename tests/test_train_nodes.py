"""Training across machines: two "machines" on this host (two real `accelerate launch` commands with
--num_machines 2, machine ranks 0 and 1, gloo on 127.0.0.1) train exactly what one machine with two
processes trains from the same plan, resume across each other, and only machine rank 0 writes
checkpoints and publishes.
"""
from __future__ import annotations

import threading
from pathlib import Path

import pytest

from lorapipe.cache.errors import UserError
from lorapipe.stages import train
from lorapipe.stages.processes.launching import free_port
from lorapipe.stages.train.checkpoints import CheckpointDir

from test_train import PARAMS, run_train, train_inputs, trajectory

pytestmark = pytest.mark.usefixtures("on_kept_prefect_server")  # its commands' flows: tests/prefect_server.py

STEPS = dict(max_steps=4, checkpoint_every=2, keep_checkpoints=2)
ONE_THREAD = {"cpu_threads": 1}  # the same torch threads per process however the processes are spread


def two_machines(tmp: Path, name: str, inputs: train.TrainInputs, rank_1_params: dict | None = None,
                 **overrides) -> tuple[Path, Path, list[str]]:
    """Machine rank 1 (`follow`, in a thread) and machine rank 0 (`run`, which publishes) of one
    training, 1 process each (rank 1's params changed by `rank_1_params`). Returns rank 0's out dir,
    rank 1's private work dir and rank 1's log."""
    port, follower_log, failures = free_port(), [], []
    options = dict(ONE_THREAD, log_with="none", num_machines=2, main_process_ip="127.0.0.1", main_process_port=port)
    params = train.TrainParams(**{**PARAMS, **STEPS, "num_processes": 2, **overrides, **(rank_1_params or {})})
    rank_1_dir = tmp / f"machine-1-{name}"

    def rank_1() -> None:
        try:
            train.follow(params, inputs, rank_1_dir, train.TrainOptions(**options, machine_rank=1), follower_log.append)
        except Exception as error:  # noqa: BLE001  raised again below, in the test's thread
            failures.append(error)

    follower = threading.Thread(target=rank_1)
    follower.start()
    try:
        out, _ = run_train(tmp, name, inputs, tmp / "work-machines", options=dict(options, machine_rank=0),
                           num_processes=2, **{**STEPS, **overrides})
    finally:
        follower.join()
    if failures:
        raise failures[0]
    return out, rank_1_dir, follower_log


@pytest.fixture(scope="module")
def one_machine(tmp_path_factory, tiny_model, encoded) -> Path:
    """The plan trained by 2 processes on one machine, straight through."""
    tmp = tmp_path_factory.mktemp("one-machine")
    out, _ = run_train(tmp, "one-machine", train_inputs(tiny_model, encoded), tmp / "work", options=ONE_THREAD,
                       num_processes=2, **STEPS)
    return out


def assert_same_losses(ours: list[tuple[int, float, float]], theirs: list[tuple[int, float, float]]) -> None:
    assert [row[0] for row in ours] == [row[0] for row in theirs]
    assert [value for row in ours for value in row[1:]] == pytest.approx(
        [value for row in theirs for value in row[1:]], rel=1e-6, abs=1e-7)


@pytest.mark.slow
def test_two_machines_train_what_one_machine_with_two_processes_trains_and_resume(one_machine, tmp_path, tiny_model,
                                                                                 encoded):
    """Two machines stop after the checkpoint at step 2, then run again to step 4: every loss equals
    the one-machine run's, and machine rank 1 never wrote a checkpoint or published."""
    inputs = train_inputs(tiny_model, encoded)
    half, rank_1_dir, rank_1_log = two_machines(tmp_path, "first-half", inputs, max_steps=2)
    assert_same_losses(trajectory(half), trajectory(one_machine)[:2])
    out, rank_1_dir, rank_1_log = two_machines(tmp_path, "resumed", inputs)
    assert "resumed from step-000002" in (out / "logs" / "train.log").read_text()
    assert_same_losses(trajectory(out), trajectory(one_machine))
    # machine rank 1 kept only its job and log: no checkpoint, no export, no loss log
    kept = sorted(p.relative_to(rank_1_dir).as_posix() for p in rank_1_dir.rglob("*") if p.is_file())
    assert kept == ["accelerate.yaml", "job.json", "logs/train.log"], kept
    assert "rank 1/2" in (rank_1_dir / "logs" / "train.log").read_text()
    assert rank_1_log[-1] == "train: machine rank 1 of 2 done; machine rank 0 publishes the LoRA and evaluates it"


@pytest.mark.slow
def test_only_rank_0_writes_checkpoints(one_machine):
    """Even beside another process in the same work directory, a checkpoint holds rank 0's files only:
    the other ranks receive the state rank 0 loads when they resume."""
    checkpoints = CheckpointDir(one_machine.parent / "work" / "checkpoints")
    assert checkpoints.steps() == [2, 4]
    for step in checkpoints.steps():
        names = {p.name for p in checkpoints.path(step).iterdir()}
        assert "random_states_0.pkl" in names and not any(n.startswith("random_states_1") for n in names), names


@pytest.mark.slow
def test_a_machine_started_with_other_settings_stops_every_machine_in_one_line(tmp_path, tiny_model, encoded):
    with pytest.raises(UserError, match=r"^train: process 1 was started with other train settings or data than"
                                        r" machine rank 0's: run the same config on every machine"):
        two_machines(tmp_path, "mismatch", train_inputs(tiny_model, encoded), rank_1_params={"seed": 4})


def test_machines_that_cannot_share_the_processes_are_refused_naming_the_key(tmp_path):
    params = train.TrainParams(**{**PARAMS, "num_processes": 3})
    options = train.TrainOptions(num_machines=2, main_process_ip="10.0.0.1")
    with pytest.raises(UserError, match=r"^train.num_processes: 3 processes cannot be spread evenly over 2 machines"):
        train.machines(params, options)
    with pytest.raises(ValueError, match="machine_rank: 2 is not below num_machines"):
        train.TrainOptions(num_machines=2, machine_rank=2, main_process_ip="10.0.0.1")
    with pytest.raises(ValueError, match="main_process_ip: set it"):
        train.TrainOptions(num_machines=2)


def test_a_users_accelerate_config_says_which_machine_this_is(tmp_path):
    config = tmp_path / "accelerate.yaml"
    config.write_text("distributed_type: MULTI_GPU\nnum_machines: 2\nmachine_rank: 1\nmain_process_ip: 10.0.0.1\n")
    params = train.TrainParams(**{**PARAMS, "num_processes": 4})
    found = train.machines(params, train.TrainOptions(accelerate_config=str(config)))
    assert (found.count, found.rank, found.launch_args) == (2, 1, ())  # accelerate reads the rest from the file


@pytest.mark.slow
def test_lorapipe_run_on_each_machine_rank_0_publishes_and_evaluates(tmp_path, tiny_config, run_stages):
    """`lorapipe run CONFIG --set train.machine_rank=N` on each "machine" (one host, one cache, two
    output folders): rank 1 joins the training without waiting on rank 0's lock, publishes and
    evaluates nothing, and ends with exit code 0; rank 0 publishes the LoRA and evaluates it."""
    import json
    import os
    import subprocess
    import sys

    from lorapipe.flows.steps import STAGES

    config = tiny_config(tmp_path, "machines", max_steps=2, checkpoint_every=2, batch_size=2, num_processes=2,
                         cpu_threads=1, log_with="none", num_machines=2, main_process_ip="127.0.0.1",
                         main_process_port=free_port())
    run_stages(config, STAGES[:2])  # preprocess and encode cached (each machine would serve them from the cache)

    def lorapipe_run(rank: int) -> subprocess.Popen:
        env = {**os.environ, "PREFECT_HOME": str(tmp_path / f"prefect-home-{rank}")}
        return subprocess.Popen([sys.executable, "-m", "lorapipe.flows.cli", "run", str(config), "--json", "--set",
                                 f"train.machine_rank={rank}", "--set", f"output_dir=out-{rank}"],
                                cwd=Path(__file__).resolve().parent.parent, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    runs = [lorapipe_run(1), lorapipe_run(0)]
    done = [run.communicate(timeout=600) for run in runs]
    for run, (_, err) in zip(runs, done):
        assert run.returncode == 0, err[-3000:]
    rank_1, rank_0 = ({row["stage"]: row for row in json.loads(out)["stages"]} for out, _ in done)
    assert [rank_1[s]["status"] for s in STAGES if s in rank_1] == ["hit", "hit", "joined"]
    assert [rank_0[s]["status"] for s in STAGES] == ["hit", "hit", "computed", "computed"]
    assert rank_1["train"]["key"] == rank_0["train"]["key"]
    assert "machine rank 0 publishes the LoRA and evaluates it" in done[0][1]
    assert (tmp_path / "out-0" / "pytorch_lora_weights.safetensors").is_file()
    assert not (tmp_path / "out-1" / "pytorch_lora_weights.safetensors").exists()
    def visible(folder: Path) -> list[str]:
        return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))

    assert visible(tmp_path / "out-1") == ["logs", "train-machine-1"]  # its summary beside its job, not here
    assert visible(tmp_path / "out-1" / "train-machine-1") == ["accelerate.yaml", "job.json", "logs", "run-summary.json"]
