"""Launching accelerate workers from a stage's parent process and streaming their log.

Used by train and by multi-process encode. The children live in the parent's process group,
write only into the stage's work_dir, and are terminated with the parent.
"""
from __future__ import annotations

import os
import socket
import subprocess
from collections import deque
from pathlib import Path

from stages.contract import Log

REPO_ROOT = Path(__file__).resolve().parents[1]
TAIL_LINES = 20


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
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    with open(log_file, "a") as sink:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   bufsize=1, env=env, cwd=REPO_ROOT)
        try:
            for line in process.stdout:
                line = line.rstrip("\n")
                tail.append(line)
                sink.write(line + "\n")
                log(line)
            code = process.wait()
        finally:
            terminate(process)
    if code != 0:
        raise RuntimeError(f"{Path(log_file).stem} failed (exit code {code}); last lines of its log:\n"
                           + "\n".join(tail))


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
