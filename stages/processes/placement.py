"""Where a stage's job (stages/processes/jobs.py) runs: placements, each an object whose `run(job, log)` runs
the job there, and `place`, the one rule that chooses among them.

- ThisProcess: the calling process (the command's, a deployment's flow run, a test's).
- OwnProcess: a process of its own, `python -m lorapipe.stages.processes.jobs JOB` (training, which hides
  from diffusers the libraries its job does not use: stages/processes/optional_libraries.py).
- AccelerateLaunch: `accelerate launch` of N processes with an accelerate config (the user's, or
  one written into the work dir), on this machine or as one machine of several.
- InWarmProcess: the warm process, a WarmProcess the command started before any job existed, so
  that its imports overlap Prefect's start; its jobs run one after another in it. A job it cannot
  take (it is gone, or it hides a library the job uses) runs where the placement it stands in for says.
- DaskCluster: the tasks of a job the stage deals in chunks (encode's), on a Dask cluster.
- BySize: one of two placements by the size of the work (encode's processes only for more than a
  batch of latents).

The plan chooses each stage's placement once per command (flows/run_plan.py) from the stage's
settings (its `where`) and the warm process, if the command started one; a stage handed none
chooses with the same rule from its own settings. The job's code never knows where it runs.

A process started for a job writes only into the job's work_dir, lives in the command's process
group and dies with it (stages/processes/launching.py); its lines go to work_dir/logs/<stage>.log and, but
for tracebacks, to the stage's log. Its error arrives as WorkerFailed (WorkerCrashed when it died
without a word, which a retry may cure), a damaged record it met as DamagedRecord, typed, so that
the flow repairs it.
"""
from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from lorapipe.cache.errors import UserError

from . import jobs, optional_libraries
from .cpu_threads import threads_per_process, torch_threads
from .jobs import DAMAGED_RECORD_FILE, Job
from .launching import WorkerFailed, environment_kept, start_worker, stream, write_accelerate_config

if TYPE_CHECKING:
    from distributed import Client

    from ..contract import Log

JOBS = "lorapipe.stages.processes.jobs"  # the worker entry every process started for a job runs
CONNECT_SECONDS = 30  # to reach a Dask scheduler at an address


class Placement:
    """Where a job runs (a frozen dataclass each)."""

    processes = 1  # the job's processes that share this machine's cores
    here = False  # whether the job runs in the calling process (which then imports its model code)

    def threads(self, setting: int | None) -> int | None:
        """Torch threads per process for a stage whose cpu_threads setting is `setting` (stages/processes/cpu_threads.py)."""
        return threads_per_process(setting, self.processes)

    def sized(self, units: int) -> Placement:
        """The placement for work of `units` (see BySize)."""
        return self

    def describe(self) -> str:
        """How the job is launched, for the stage's log line."""
        return "(no launcher)"

    def run(self, job: Job, log: Log) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class ThisProcess(Placement):
    here = True

    def run(self, job: Job, log: Log) -> None:
        jobs.run(job, log)


@dataclass(frozen=True)
class OwnProcess(Placement):
    def run(self, job: Job, log: Log) -> None:
        path = job.write()
        watch(start_worker([sys.executable, "-m", JOBS, str(path)], job_env(job)), job, log)


@dataclass(frozen=True)
class Machines:
    """The machines a launch runs on: how many, this one's rank, and the launcher's arguments that
    say so (none when the user's accelerate config says it)."""

    count: int = 1
    rank: int = 0
    launch_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class AccelerateLaunch(Placement):
    total: int  # processes on every machine (accelerate's --num_processes)
    config: Path | None = None  # the user's accelerate config; None: one written for DDP
    machines: Machines = Machines()

    @property
    def processes(self) -> int:
        return self.total // self.machines.count

    def describe(self) -> str:
        how = f"with accelerate config {self.config}" if self.config else "under accelerate launch"
        if self.machines.count > 1:
            how += f" as machine rank {self.machines.rank} of {self.machines.count}"
        return how

    def run(self, job: Job, log: Log) -> None:
        path = job.write()
        config = self.config or write_accelerate_config(job.work_dir / "accelerate.yaml", self.total)
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                   "--num_processes", str(self.total), *self.machines.launch_args,
                   "--num_cpu_threads_per_process", str(job.threads), "-m", JOBS, str(path)]
        watch(start_worker(command, job_env(job)), job, log)


@dataclass(frozen=True)
class InWarmProcess(Placement):
    warm: WarmProcess
    instead: Placement  # where a job the warm process cannot take runs

    def describe(self) -> str:
        return self.instead.describe()

    def run(self, job: Job, log: Log) -> None:
        if not self.warm.run(job, log):
            self.instead.run(job, log)


@dataclass(frozen=True)
class BySize(Placement):
    """`large` for work of more than `up_to` units, else `small`: a stage sizes it first (`sized`)."""

    up_to: int
    small: Placement
    large: Placement

    @property
    def here(self) -> bool:  # what a run of little work does: the usual case
        return self.small.here

    def sized(self, units: int) -> Placement:
        return self.large if units > self.up_to else self.small

    def run(self, job: Job, log: Log) -> None:
        raise TypeError("a BySize placement runs nothing itself: call sized(units) for the placement")


@dataclass(frozen=True)
class DaskCluster(Placement):
    """The cluster at `address`, or a local one of `workers` processes (one task at a time each)
    started for the job and stopped after it. The stage's dealer (stages/processes/jobs.py DEALERS) hands its
    job over in chunks: `deal(job, pool, log)` with a DaskPool, whose tasks a worker's death makes
    Dask run again, returns the job's result."""

    address: str | None = None
    workers: int = 2

    def threads(self, setting: int | None) -> int | None:
        """On the local cluster, the rule every stage follows for its `workers` processes; on a
        cluster at an address (other machines, started by the user) the setting, else the worker's own."""
        return setting if self.address else threads_per_process(setting, self.workers)

    def run(self, job: Job, log: Log) -> None:
        with self.client(log) as client:
            result = jobs.dealer(job.stage).deal(job, DaskPool(client, job.threads), log)
        jobs.write_result(job.work_dir, result, 0)  # as one process's

    @contextmanager
    def client(self, log: Log) -> Iterator[Client]:
        try:
            from distributed import Client, LocalCluster
        except ImportError:
            raise UserError("encode.executor: dask needs Dask's distributed package: pip install 'lorapipe[dask]'"
                            " (or pip install distributed), or set executor: local") from None
        if self.address:
            try:
                client = Client(self.address, timeout=CONNECT_SECONDS)
            except (OSError, TimeoutError) as e:
                raise UserError(f"encode.dask_address: no Dask scheduler answered at {self.address} within"
                                f" {CONNECT_SECONDS} s ({e}): start one (dask scheduler) or fix the address") from None
            with client:
                yield client
            return
        log(f"encode: starting a local Dask cluster of {self.workers} worker processes")
        # its workers run only the job's tasks: they hide the optional libraries, which a worker of a
        # cluster at an address (long-lived, maybe shared with tasks that use them) must keep
        with environment_kept(), LocalCluster(n_workers=self.workers, threads_per_worker=1, processes=True,
                                              dashboard_address=":0", preload=[optional_libraries.__name__]
                                              ) as cluster, Client(cluster) as client:
            yield client


@dataclass(frozen=True)
class DaskPool:
    """A job's tasks on a Dask cluster, each on `threads` torch threads (None: the worker's own)."""

    client: Client
    threads: int | None

    @property
    def workers(self) -> int:
        return len(self.client.scheduler_info()["workers"])

    def describe(self) -> str:
        return f"{self.workers} Dask workers" + (f", {self.threads} torch threads each" if self.threads else "")

    def map(self, fn: Callable, tasks: list[tuple[str, tuple]]) -> Iterator:
        """fn(*args) for each (key, args) of `tasks` as a task named key; the results as they come."""
        from distributed import as_completed

        futures = [self.client.submit(on_threads, self.threads, fn, *args, key=key, pure=False) for key, args in tasks]
        for _, result in as_completed(futures, with_results=True):
            yield result


def on_threads(threads: int | None, fn: Callable, *args):
    """In a Dask worker: fn(*args) on `threads` torch threads."""
    if threads is None:
        return fn(*args)
    with torch_threads(threads):
        return fn(*args)


class WarmProcess:
    """A job process (`python -m lorapipe.stages.processes.jobs --serve`) started before its jobs exist, so
    that its imports (torch, diffusers, peft, accelerate: most of the seconds before a small job's
    first step) overlap Prefect's start and the stages before its jobs, and are paid once for
    encode, train and evaluate together. It hides `hidden` and imports the workers of `warm_up`
    first; each job then runs on its own threads. The command that starts it owns it (a context
    manager) and hands it to its stages in their placements (InWarmProcess); it ends once the
    command does, or when told that no job will come (`end`), and like every worker it dies with
    its parent."""

    def __init__(self, threads: int, hidden: tuple[str, ...] = (), warm_up: tuple[str, ...] = ("train",),
                 env: dict[str, str] | None = None):
        """`threads`: OMP_NUM_THREADS in its environment (training's: stages/processes/cpu_threads.py); `env` adds to it."""
        self.hidden = frozenset(hidden)
        command = [sys.executable, "-m", JOBS, "--serve", *(f"--hide={name}" for name in sorted(self.hidden)),
                   *(f"--warm-up={stage}" for stage in warm_up)]
        self.process = start_worker(command, {"OMP_NUM_THREADS": str(threads), **(env or {})}, stdin=True)

    def __enter__(self) -> WarmProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.end()

    def alive(self) -> bool:
        return self.process.poll() is None

    def run(self, job: Job, log: Log) -> bool:
        """Run `job` here, streaming what it prints (see `watch`) until it is done; False, having
        run nothing, when this process is gone or hides a library the job uses."""
        if not self.hidden <= set(job.hidden) or not self._send(job.write()):
            return False
        log(f"{job.stage}: in the process started ahead")
        watch(self.process, job, log, job_done=True)
        return True

    def end(self) -> None:
        """No job will come: the process ends once its job is done."""
        try:
            self.process.stdin.close()
        except BrokenPipeError:  # it died with unread input
            pass

    def _send(self, path: Path) -> bool:
        if not self.alive():
            return False
        try:
            self.process.stdin.write(f"{path}\n")
            self.process.stdin.flush()
        except BrokenPipeError:  # it died just now
            return False
        return True


def run_at(placement: Placement, job: Job, log: Log) -> None:
    """Run `job` where `placement` says, the results of an earlier run removed first (jobs.gather
    then reads this run's)."""
    jobs.remove_results(job.work_dir)
    placement.run(job, log)


def watch(process: subprocess.Popen, job: Job, log: Log, job_done: bool = False) -> None:
    """Stream `process`'s lines into work_dir/logs/<stage>.log and `log` until it exits (with
    `job_done`, until it says the job is done: stages/processes/launching.py stream); raise a damaged record
    it reported as DamagedRecord, its other errors as stream does."""
    damaged = job.work_dir / DAMAGED_RECORD_FILE
    damaged.unlink(missing_ok=True)
    try:
        stream(process, job.work_dir / "logs" / f"{job.stage}.log", log, job_done=job_done)
    except WorkerFailed as failure:
        if damaged.is_file():
            from lorapipe.cache.samples import DamagedRecord

            raise DamagedRecord.from_json(json.loads(damaged.read_text())) from failure
        raise


def job_env(job: Job) -> dict[str, str]:
    """What a process started for `job` adds to its environment: its torch threads."""
    return {"OMP_NUM_THREADS": str(job.threads)} if job.threads else {}


@dataclass(frozen=True)
class Where:
    """What a stage's settings say about where its job runs; `place` decides."""

    processes: int = 1  # on every machine: more than one runs under accelerate launch
    accelerate_config: Path | None = None  # the user's: the job is launched with it, whatever the count
    machines: Machines = Machines()
    own_process: bool = False  # one process: one of its own (training), else the calling one
    dask: DaskCluster | None = None  # the job's chunks on a Dask cluster
    one_process_up_to: int | None = None  # with several processes: one for work of at most this size


def place(where: Where, warm: WarmProcess | None = None) -> Placement:
    """The one rule: a Dask cluster when asked for; else `accelerate launch` for several processes or
    the user's accelerate config; else one process: the warm process when the command started one,
    standing in for a process of its own (training) or the calling one."""
    if where.dask is not None:
        return where.dask
    one: Placement = OwnProcess() if where.own_process else ThisProcess()
    if warm is not None:
        one = InWarmProcess(warm, one)
    if where.processes == 1 and where.accelerate_config is None:
        return one
    launch = AccelerateLaunch(where.processes, where.accelerate_config, where.machines)
    return launch if where.one_process_up_to is None else BySize(where.one_process_up_to, one, launch)
