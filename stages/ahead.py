"""A worker process started before its jobs exist, so that its imports (torch, diffusers, peft,
accelerate: most of the seconds before a small job's first step) overlap Prefect's start and the
stages that run before its jobs, and are paid once for encode and train together.

    python -m stages.ahead MODULE...

hides the optional libraries its environment names (stages/optional_libraries.py), imports each
MODULE and calls its `warm_up()`, then reads jobs on stdin, one line each, `MODULE JOB_PATH`, run
by MODULE's `run_job(JOB_PATH)`; after each job it prints JOB_DONE (stages/launching.py) and reads
the next line, and it ends at end-of-file. A job that fails ends the process as a worker's error
does (reporting_errors), so a later stage starts its own process instead.

`lorapipe run` starts one when training will run in one process without a launcher (flows/commands.py,
stages/train/launch.py start_ahead). A stage that would otherwise run the same work hands it over:
encode lends it its single-process job (`lend`: the process then waits for the next job), train
gives it the last one (`take`: its stdin is closed). A process nobody takes reads end-of-file when
the command exits, and ends; like every worker it also dies with its parent.
"""
from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

from stages.launching import JOB_DONE, die_with_parent, skip_exit_collection, start_worker, write_whole_lines
from stages.optional_libraries import hide_named

_waiting: dict[tuple, subprocess.Popen] = {}  # its added environment -> a process waiting for a job


def start_ahead(env: dict[str, str], modules: tuple[str, ...]) -> None:
    """Start a worker for the jobs of `modules`, with `env` added to its environment."""
    if _key(env) not in _waiting:
        _waiting[_key(env)] = start_worker([sys.executable, "-m", "stages.ahead", *modules], env, stdin=True)


def waiting() -> bool:
    """Whether a process started ahead is waiting for a job."""
    return any(process.poll() is None for process in _waiting.values())


def lend(module: str, job: Path) -> subprocess.Popen | None:
    """A process started ahead (whatever its environment), now running `module`'s `job` and
    staying for another; None if there is none or it is gone."""
    for key, process in list(_waiting.items()):
        if _send(process, module, job, last=False):
            return process
        del _waiting[key]
    return None


def take(env: dict[str, str], module: str, job: Path) -> subprocess.Popen | None:
    """The process started ahead with the environment `env`, now running `module`'s `job`, its
    last; None if there is none or it is gone."""
    process = _waiting.pop(_key(env), None)
    return process if process is not None and _send(process, module, job, last=True) else None


def _send(process: subprocess.Popen, module: str, job: Path, last: bool) -> bool:
    if process.poll() is not None:
        return False
    try:
        process.stdin.write(f"{module} {job}\n")
        process.stdin.flush()
        if last:
            process.stdin.close()
    except BrokenPipeError:  # it died just now
        return False
    return True


def _key(env: dict[str, str]) -> tuple:
    return tuple(sorted(env.items()))


def main(modules: list[str]) -> None:
    write_whole_lines()
    die_with_parent()
    hide_named()  # before the modules import diffusers
    for name in modules:
        getattr(importlib.import_module(name), "warm_up", lambda: None)()
    for line in sys.stdin:
        name, job = line.rstrip("\n").split(" ", 1)
        importlib.import_module(name).run_job(Path(job))
        print(JOB_DONE, flush=True)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    finally:
        skip_exit_collection()
