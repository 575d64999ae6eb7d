"""A training process started before its job exists, so that its imports (torch, diffusers, peft,
accelerate: most of the seconds between launching the recipe and its first step on a small job)
overlap the stages that run before training.

`lorapipe run` starts one when it sees that training will run (flows/commands.py); the train stage
hands it the job file's path on its stdin (`take`) instead of starting a process, when it would have
started the same one: a single process without accelerate's launcher, with the same environment
(thread count, hidden libraries: stages/optional_libraries.py).
A process nobody takes reads end-of-file when the command exits, and ends; like every worker it
also dies with its parent (stages/launching.py).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from stages.launching import start_worker

WAIT_FOR_JOB = "--job-on-stdin"  # the recipe's argument instead of a job path
_waiting: dict[tuple, subprocess.Popen] = {}  # its added environment -> a process waiting for its job


def direct_command(job: Path | str) -> list[str]:
    """The recipe run without a launcher: one process."""
    return [sys.executable, "-m", "stages.train.recipe", str(job)]


def start_ahead(env: dict[str, str]) -> None:
    """Start the recipe waiting for its job, with `env` added to its environment."""
    if _key(env) not in _waiting:
        _waiting[_key(env)] = start_worker(direct_command(WAIT_FOR_JOB), env, stdin=True)


def take(env: dict[str, str], job: Path) -> subprocess.Popen | None:
    """The process started ahead with the environment `env`, now running `job`; None if there is
    none or it is gone."""
    process = _waiting.pop(_key(env), None)
    if process is None or process.poll() is not None:
        return None
    try:
        process.stdin.write(f"{job}\n")
        process.stdin.close()
    except BrokenPipeError:  # it died just now
        return None
    return process


def _key(env: dict[str, str]) -> tuple:
    return tuple(sorted(env.items()))


def wait_for_job() -> Path | None:
    """In the recipe started ahead: import what training needs, then read the job's path (None at
    end-of-file: the run did not need this process)."""
    import accelerate  # noqa: F401
    import diffusers.optimization  # noqa: F401
    import diffusers.training_utils  # noqa: F401
    import peft  # noqa: F401  (diffusers.training_utils brings every family's model classes)

    line = sys.stdin.readline().strip()
    return Path(line) if line else None
