"""Launching accelerate workers from a stage's parent process and streaming their log.

Used by train and by multi-process encode. The children live in the parent's process group,
write only into the stage's work_dir, and are terminated with the parent: on an exception or
Ctrl-C by `terminate`, and on Linux even when the parent is SIGKILLed, by the kernel
(PR_SET_PDEATHSIG, set in the launcher before it runs and by each worker at its start).
A worker reports an error meant for the user as one line starting with ERROR_PREFIX; the
parent's exception then begins with that line.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
from collections import deque
from pathlib import Path

from stages.contract import Log

REPO_ROOT = Path(__file__).resolve().parents[1]
TAIL_LINES = 20
PARENT_ENV = "LORAPIPE_STAGE_PID"  # the stage process a worker must not outlive
ERROR_PREFIX = "error: "
PR_SET_PDEATHSIG = 1


def _prctl():
    """libc's prctl, resolved before any fork: the preexec hook must not load libraries."""
    return ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def die_with_parent() -> None:
    """In a worker: SIGTERM this process when its parent (the launcher) exits, and exit now if
    the stage process that started the launcher is already gone (it died before this ran)."""
    import psutil

    prctl = _prctl()
    if prctl is None:
        return
    if prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    stage = int(os.environ.get(PARENT_ENV, "0"))
    if stage and (not psutil.pid_exists(stage) or psutil.Process(stage).status() == psutil.STATUS_ZOMBIE):
        os.kill(os.getpid(), signal.SIGTERM)


def write_accelerate_config(path: Path, num_processes: int) -> Path:
    """On CPU, DDP needs MULTI_GPU + use_cpu (MULTI_CPU, or --cpu, starts one process)."""
    import torch
    import yaml

    config = {
        "compute_environment": "LOCAL_MACHINE", "num_machines": 1, "machine_rank": 0,
        "num_processes": num_processes, "use_cpu": not torch.cuda.is_available(),
        "distributed_type": "MULTI_GPU" if num_processes > 1 else "NO",
    }
    if num_processes > 1:
        config["main_process_port"] = free_port()  # concurrent launches must not share a port
    path.write_text(yaml.safe_dump(config, sort_keys=True))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_streaming(command: list[str], log_file: Path, log: Log) -> None:
    """Run `command`, sending each output line to `log` and `log_file`; raise if it fails.
    The error names the log file's stem (train.log -> "train failed")."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",  # every input is a local path
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
           PARENT_ENV: str(os.getpid())}
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    errors: list[str] = []
    with open(log_file, "a", buffering=1) as sink:  # line-buffered: the log can be followed live
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   bufsize=1, env=env, cwd=REPO_ROOT, preexec_fn=_die_with(os.getpid()))
        try:
            for line in process.stdout:
                line = line.rstrip("\n")
                tail.append(line)
                if line.startswith(ERROR_PREFIX):
                    errors.append(line.removeprefix(ERROR_PREFIX))
                sink.write(line + "\n")
                log(line)
            code = process.wait()
        finally:
            terminate(process)
    if code != 0:
        reason = f"{errors[0]}\n" if errors else ""
        raise RuntimeError(f"{reason}{Path(log_file).stem} failed (exit code {code}); last lines of its log:\n"
                           + "\n".join(tail))


def _die_with(stage_pid: int):
    """The launcher's preexec hook: SIGTERM when the stage process exits, even by SIGKILL. It runs
    between fork and exec, so it only calls the prctl resolved here and os.getppid."""
    prctl = _prctl()
    if prctl is None:
        return None

    def hook() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != stage_pid:  # the stage died between fork and prctl
            os._exit(1)

    return hook


def terminate(process: subprocess.Popen) -> None:
    """Stop the launcher and every worker it started (accelerate's single-process launcher
    does not pass SIGTERM on to its child)."""
    import psutil

    if process.poll() is not None:
        return
    try:
        family = psutil.Process(process.pid).children(recursive=True) + [psutil.Process(process.pid)]
    except psutil.NoSuchProcess:
        return
    for member in family:
        member.terminate()
    _, alive = psutil.wait_procs(family, timeout=15)
    for member in alive:
        member.kill()
    process.wait()
