"""A worker process started before its jobs exist, so that its imports (torch, diffusers, peft,
accelerate: most of the seconds before a small job's first step) overlap Prefect's start and the
stages that run before its jobs, and are paid once for encode, train and evaluate together.

    python -m lorapipe.stages.ahead MODULE...

hides the optional libraries its environment names (stages/optional_libraries.py), imports each
MODULE and calls its `warm_up()`, then reads jobs on stdin, one line each, `MODULE JOB_PATH`, run
by MODULE's `run_job(JOB_PATH)`; after each job it prints JOB_DONE (stages/launching.py) and reads
the next line (after freeing what the job left on the GPU), and it ends at end-of-file. A job
that fails ends the process as a worker's error does (reporting_errors), so a later stage works
in a process of its own or in the command's instead.

`lorapipe run` starts one when training will run in one process without a launcher (flows/commands.py,
stages/train/launch.py start_ahead). A stage that would otherwise work in a process of its own or
in the command's hands it its job instead (`lend`): encode's single-process job, then training's,
then evaluate's, each once the last is done. The command ends it when its flow is done (`end`);
it also reads end-of-file when the command exits, and like every worker it dies with its parent.
"""
from __future__ import annotations

import gc
import importlib
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from lorapipe.stages.launching import JOB_DONE, begin_worker, skip_exit_collection, start_worker, stream
from lorapipe.stages.optional_libraries import hide_named

if TYPE_CHECKING:
    from lorapipe.stages.contract import Log

_waiting: dict[tuple, subprocess.Popen] = {}  # its added environment -> a process waiting for a job


def start_ahead(env: dict[str, str], modules: tuple[str, ...]) -> None:
    """Start a worker for the jobs of `modules`, with `env` added to its environment."""
    if _key(env) not in _waiting:
        _waiting[_key(env)] = start_worker([sys.executable, "-m", "lorapipe.stages.ahead", *modules], env, stdin=True)


def waiting() -> bool:
    """Whether a process started ahead is waiting for a job."""
    return any(process.poll() is None for process in _waiting.values())


def lend(module: str, job: Path, env: dict[str, str] | None = None) -> subprocess.Popen | None:
    """A process started ahead (with the environment `env`, or any), now running `module`'s `job`;
    None if there is none or it is gone. It stays for the next job."""
    for key, process in list(_waiting.items()):
        if env is not None and key != _key(env):
            continue
        if _send(process, module, job):
            return process
        del _waiting[key]
    return None


def run_lent(stage: str, module: str, job: Path, log_file: Path, log: Log) -> bool:
    """Run `module`'s `job` in a process started ahead, streaming what it prints into `log_file`
    and `log` (stages/launching.py stream) until the job is done; False when there is none."""
    process = lend(module, job)
    if process is None:
        return False
    log(f"{stage}: in the process started ahead")
    stream(process, log_file, log, job_done=True)
    return True


def end() -> None:
    """Tell every process started ahead that no job will come: each ends once its job is done."""
    while _waiting:
        _, process = _waiting.popitem()
        try:
            process.stdin.close()
        except BrokenPipeError:  # it died with unread input
            pass


def _send(process: subprocess.Popen, module: str, job: Path) -> bool:
    if process.poll() is not None:
        return False
    try:
        process.stdin.write(f"{module} {job}\n")
        process.stdin.flush()
    except BrokenPipeError:  # it died just now
        return False
    return True


def _key(env: dict[str, str]) -> tuple:
    return tuple(sorted(env.items()))


def main(modules: list[str]) -> None:
    begin_worker()
    hide_named()  # before the modules import diffusers
    for name in modules:
        getattr(importlib.import_module(name), "warm_up", lambda: None)()
    for line in sys.stdin:
        name, job = line.rstrip("\n").split(" ", 1)
        importlib.import_module(name).run_job(Path(job))
        release_accelerator_memory()
        print(JOB_DONE, flush=True)


def release_accelerator_memory() -> None:
    """Between two jobs: free what the last one left on the GPU (its models' memory, which a
    reference cycle may hold until a collection), so the next one can load its own. On a CPU,
    freed by reference counting as usual, spared the collection's ~0.3 s."""
    import torch

    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    finally:
        skip_exit_collection()
