"""Starting a stage's worker processes (stages/processes/placement.py) and streaming their log.

The children live in the parent's process group, write only into the stage's work_dir, and are
terminated with the parent: on an exception or
Ctrl-C by `terminate`, and on Linux even when the parent is SIGKILLed, by the kernel
(PR_SET_PDEATHSIG, set in the launcher before it runs and by each worker at its start).
A worker reports its exception as one line starting with ERROR_PREFIX (`reporting_errors`), then
its traceback; the parent raises WorkerFailed with that line. A worker that dies without a word
(killed by a signal or the OOM killer, a segfault) makes the parent raise WorkerCrashed, which a
retry may cure. Tracebacks in the workers' output go to the stage's log file and to the
`lorapipe.detail` logger (the run's log file), not to the stage's `log`: the terminal shows the one line.
"""
from __future__ import annotations

import ctypes
import gc
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import lorapipe
from lorapipe.cache.errors import UserError, blame_full_disk_on, user_message
from lorapipe.stages.processes.library_notes import quiet_harmless_notes

if TYPE_CHECKING:
    from lorapipe.stages.contract import Log

IMPORT_ROOT = Path(lorapipe.__file__).resolve().parents[1]  # where `import lorapipe` found it: a checkout or site-packages
TRACEBACK_START = "Traceback (most recent call last):"
PARENT_ENV = "LORAPIPE_STAGE_PID"  # the stage process a worker must not outlive
ERROR_PREFIX = "error: "
JOB_DONE = "lorapipe: job done"  # the warm process ends each job with it (stages/processes/jobs.py)
PR_SET_PDEATHSIG = 1
detail_log = logging.getLogger("lorapipe.detail")  # lines for the log file, not the terminal


class WorkerFailed(UserError):
    """A worker process stopped on an exception and reported it in one line."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) stopped a stage; the message says what was kept and how to go on."""


class WorkerCrashed(RuntimeError):
    """A worker process died without reporting an error: killed by a signal (the OOM killer),
    or crashed. Nothing says the input is at fault, so a retry may succeed."""


def _prctl():
    """libc's prctl, resolved before any fork: the preexec hook must not load libraries."""
    return ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def skip_exit_collection() -> None:
    """Spare the interpreter the garbage collection it runs at exit, which walks every object that
    torch, diffusers and Prefect created (its cost: BENCHMARKS.md, start-up). gc.freeze() puts the objects that exist now
    out of its reach. Call it when the process's work is done: its files are closed by then, and
    atexit handlers still run."""
    gc.freeze()


def begin_worker() -> None:
    """First in the main of every process that runs a stage's job (stages/processes/jobs.py), so that none
    goes without: write whole lines, die with the stage process, and drop the library notes that
    tell a user nothing (stages/processes/library_notes.py: the output of a worker is the user's terminal and
    the run's log)."""
    write_whole_lines()
    die_with_parent()
    quiet_harmless_notes()


def write_whole_lines() -> None:
    """In a worker: write each line of stdout and stderr in one system call. Workers run with
    PYTHONUNBUFFERED=1 (so the parent sees a line as soon as it is printed), which makes print()
    write the text and its newline in two calls; the processes of one launch share a pipe, so
    two ranks' lines could merge into one. Line buffering sends "text\n" at once."""
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=False)


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


@contextmanager
def environment_kept() -> Iterator[None]:
    """Put this process's environment back as it was when the block ends. Dask's nanny writes its
    pre-spawn variables (OMP_NUM_THREADS=1, MKL_NUM_THREADS=1, ...) into its parent's os.environ
    each time it starts a worker, so every process started afterwards, training included, ran on one
    torch thread."""
    before = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(before)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_worker(command: list[str], env: dict[str, str] | None = None, stdin: bool = False) -> subprocess.Popen:
    """Start `command` (importing lorapipe from where this process did), its output (stdout and
    stderr) to a pipe, dying with this process; `env` adds to the environment; `stdin`: a pipe to
    send it its job."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",  # every input is a local path
           "PYTHONPATH": os.pathsep.join(filter(None, [str(IMPORT_ROOT), os.environ.get("PYTHONPATH")])),
           PARENT_ENV: str(os.getpid()), **(env or {})}
    return start_child(command, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, bufsize=1, env=env)


def start_child(command: list[str], **popen_args) -> subprocess.Popen:
    """subprocess.Popen(command, **popen_args) for a child that dies with this process (`die_with`).
    A Ctrl-C meanwhile is raised once it has started: the preexec hook makes Python run its at-fork
    handlers (logging's takes and releases its module lock), and a KeyboardInterrupt raised inside
    one is printed and dropped with the lock left taken, which hung the command at its next log
    line instead of stopping it."""
    with sigint_deferred():
        return subprocess.Popen(command, preexec_fn=die_with(os.getpid()), **popen_args)


@contextmanager
def sigint_deferred() -> Iterator[None]:
    """SIGINT, should it come during the block, delivered when the block ends (in the main thread,
    the only one Python delivers signals to; elsewhere the block runs as it is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda number, frame: caught.append(number))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            signal.raise_signal(signal.SIGINT)


def run_streaming(command: list[str], log_file: Path, log: Log) -> None:
    """Run `command` (see `stream`)."""
    stream(start_worker(command), log_file, log)


def stream(process: subprocess.Popen, log_file: Path, log: Log, job_done: bool = False) -> None:
    """Send each line `process` prints to `log_file`, stamped with the wall time, and, tracebacks
    aside, to `log`, until it exits, or with `job_done` until it says JOB_DONE (it stays, for its
    next job: the warm process, stages/processes/jobs.py); stop it and its children if this is interrupted. Raise
    WorkerFailed with the first error a worker reported, or WorkerCrashed if none did."""
    errors: list[str] = []
    with open(log_file, "a", buffering=1) as sink:  # line-buffered: the log can be followed live
        try:
            for line, is_detail in _classified(process.stdout, errors):
                if line == JOB_DONE:
                    if job_done:
                        return
                    continue
                sink.write(f"{wall_time()} {line}\n")
                (detail_log.info if is_detail else log)(line)
            code = process.wait()
        except BaseException:
            terminate(process)
            raise
    name = Path(log_file).stem
    if code != 0 and errors:
        raise WorkerFailed(f"{name}: {errors[0]}")
    if code != 0:
        raise WorkerCrashed(f"the {name} process died without reporting an error (exit code {code}; killed by a"
                            f" signal or out of memory?); its log: {log_file}")


def wall_time() -> str:
    """Now, as log rows carry it: 2026-11-23 09:11:29.733 (local time)."""
    now = time.time()
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"


def _classified(lines: Iterator[str], errors: list[str]) -> Iterator[tuple[str, bool]]:
    """(line, is_detail) for each output line: detail is a Python traceback (up to and including its
    exception line) and whatever follows a worker's error report (its traceback, the launcher's)."""
    in_traceback = False
    for line in lines:
        line = line.rstrip("\n")
        if line.startswith(ERROR_PREFIX):
            errors.append(line.removeprefix(ERROR_PREFIX))
            yield line, True  # the parent's exception carries it
            continue
        ends_traceback = in_traceback and not line.startswith(" ")
        in_traceback = (in_traceback or line == TRACEBACK_START) and not ends_traceback
        yield line, bool(errors) or in_traceback or ends_traceback


@contextmanager
def reporting_errors(writes_into: Path) -> Iterator[None]:
    """In a worker's main: report an exception as one ERROR_PREFIX line (the user's line for an
    error the user can fix; a full disk named by `writes_into`, the cache folder the worker writes
    in), then its traceback, and exit with status 1; on Ctrl-C exit quietly."""
    try:
        yield
    except KeyboardInterrupt:  # Ctrl-C reaches the workers too: the parent tells the user, once
        sys.exit(130)
    except Exception as error:
        blame_full_disk_on(error, writes_into)
        line = user_message(error) or f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        print(f"{ERROR_PREFIX}{line}", flush=True)
        traceback.print_exc(file=sys.stdout)
        sys.stdout.flush()
        sys.exit(1)


def die_with(parent_pid: int):
    """A child's preexec hook: SIGTERM when its parent `parent_pid` exits, even by SIGKILL. It runs
    between fork and exec, so it only calls the prctl resolved here and os.getppid."""
    prctl = _prctl()
    if prctl is None:
        return None

    def hook() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died between fork and prctl
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
