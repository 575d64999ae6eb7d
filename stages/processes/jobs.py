"""One job description and one worker entry for the stages whose work runs wherever its placement
says (stages/processes/placement.py): caption, encode, train and evaluate.

A stage's `run` (its parent side) describes its work as a Job and hands it to its placement, which
runs it in this process, in a process of its own, under `accelerate launch`, in the warm process or
on a Dask cluster. A job carries its stage's typed spec (SPECS); the worker side is the module
WORKERS names for the stage: its `run_job(job, log)` does the work and returns the stage's typed
result (a JobResult: what failed, what it built), which this layer writes into the job's work_dir
as RESULT_FILE, one per rank, and the parent reads back with `gather`.

    python -m lorapipe.stages.processes.jobs WORK/job.json                   # one job in a process of its own
    accelerate launch ... -m lorapipe.stages.processes.jobs WORK/job.json    # every rank runs it (RANK, WORLD_SIZE)
    python -m lorapipe.stages.processes.jobs --serve [--hide NAME]... [--warm-up STAGE]...   # the warm process

The entry reads the job (its spec's model is in a module that imports no model library), hides the
optional libraries the job never uses (stages/processes/optional_libraries.py), and only then imports
the stage's worker, which imports torch and diffusers as any module does. With --serve it is the warm
process (stages/processes/placement.py WarmProcess): it hides the NAMEs and imports each STAGE's
worker (and calls its `warm_up`) before any job exists, then reads job paths on stdin, one a line,
and prints JOB_DONE after each (after freeing what the job left on the GPU); it ends at end-of-file.
A job that fails ends the process as a worker's error does (`reporting_errors`), so a later job runs
elsewhere.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable, Generic, TypeVar

from lorapipe.cache.fsutil import write_json_atomic
from lorapipe.stages.contract import Frozen
from lorapipe.stages.processes.cpu_threads import torch_threads
from lorapipe.stages.processes.launching import JOB_DONE, begin_worker, reporting_errors, skip_exit_collection
from lorapipe.stages.processes.optional_libraries import hide

WORKERS = {  # stage -> the module of its worker side: run_job(job, log), and warm_up() for the warm process
    "caption": "lorapipe.stages.caption.workers",
    "encode": "lorapipe.stages.encode.workers",
    "train": "lorapipe.stages.train.recipe",
    "evaluate": "lorapipe.stages.evaluate.worker",
}
SPECS = {  # stage -> "module:name" of its job's spec, in a module that imports no model library (a job
    # file is read before the libraries the job never uses are hidden)
    "caption": "lorapipe.stages.caption.workers:CaptionSpec",
    "encode": "lorapipe.stages.encode.workers:EncodeSpec",
    "train": "lorapipe.stages.train.params:TrainSpec",
    "evaluate": "lorapipe.stages.evaluate.worker:EvalSpec",
}
DEALERS = {  # stage -> the module whose deal(job, pool, log) hands its job to a Dask cluster in chunks
    # and returns its result
    "encode": "lorapipe.stages.encode.dask_executor",
}
JOB_FILE = "job.json"  # in the job's work_dir
DAMAGED_RECORD_FILE = "damaged-record.json"  # the damaged record a worker met (lorapipe.cache.samples.DamagedRecord)
RESULT_FILE = "result-{rank}.json"  # in the job's work_dir: what that rank's run_job returned (a JobResult)

Spec = TypeVar("Spec", bound=Frozen)
Result = TypeVar("Result", bound="JobResult")


@dataclass(frozen=True)
class Job(Generic[Spec]):
    """A stage's work, as its worker reads it."""

    stage: str
    spec: Spec  # the stage's spec (SPECS): its params, inputs, options and what to do
    work_dir: Path  # the worker writes only here (and into the cache or out_dir its spec names)
    threads: int | None = None  # torch's CPU threads (stages/processes/cpu_threads.py); None: the process's own
    hidden: tuple[str, ...] = ()  # the optional libraries the job never uses
    writes_into: Path | None = None  # the folder named when its disk is full (default: work_dir)

    @property
    def path(self) -> Path:
        return self.work_dir / JOB_FILE

    def to_json(self) -> dict:
        return {"stage": self.stage, "spec": self.spec.model_dump(mode="json"), "work_dir": str(self.work_dir),
                "threads": self.threads, "hidden": list(self.hidden),
                "writes_into": str(self.writes_into) if self.writes_into else None}

    @classmethod
    def from_json(cls, value: dict) -> Job:
        return cls(value["stage"], spec_model(value["stage"]).model_validate(value["spec"]), Path(value["work_dir"]),
                   value["threads"], tuple(value["hidden"]),
                   Path(value["writes_into"]) if value["writes_into"] else None)

    def write(self) -> Path:
        """Write the job into work_dir/job.json in one rename; returns its path."""
        (self.work_dir / "logs").mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_name(f".{JOB_FILE}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(self.to_json(), indent=1, sort_keys=True))
        os.replace(temporary, self.path)
        return self.path

    @classmethod
    def read(cls, path: Path) -> Job:
        return cls.from_json(json.loads(Path(path).read_text()))


class JobResult(Frozen):
    """What a stage's job reports besides its files, one model per stage: each rank that returns one
    from run_job has it written into RESULT_FILE, and the parent reads them back (`gather`)."""

    @classmethod
    def merged(cls: type[Result], ranks: list[Result]) -> Result:
        """The job's result from its ranks': a result that one process writes has just one."""
        if len(ranks) != 1:
            raise ValueError(f"{cls.__name__} is written by one process, not by {len(ranks)}")
        return ranks[0]


class SplitResult(JobResult):
    """A result each rank writes its share of (the images it could not read): every field is a
    mapping, and the ranks' are merged by key."""

    @classmethod
    def merged(cls: type[Result], ranks: list[Result]) -> Result:
        return cls(**{name: {key: value for rank in ranks for key, value in getattr(rank, name).items()}
                      for name in cls.model_fields})


def spec_model(stage: str) -> type[Frozen]:
    """The model of `stage`'s spec (SPECS)."""
    module, name = SPECS[stage].split(":")
    return getattr(importlib.import_module(module), name)


def remove_results(work_dir: Path) -> None:
    """Before a job runs: the results of an earlier run of it, so that `gather` reads only this one's."""
    for stale in work_dir.glob(RESULT_FILE.format(rank="*")):
        stale.unlink()


def write_result(work_dir: Path, result: JobResult, rank: int) -> None:
    write_json_atomic(work_dir / RESULT_FILE.format(rank=rank), result.model_dump())


def gather(work_dir: Path, model: type[Result], ranks: int = 1) -> Result:
    """The result of a job that `ranks` processes ran (only rank 0 for a result one process
    writes): each rank's read back from work_dir, merged (`model.merged`)."""
    return model.merged([model.model_validate(json.loads((work_dir / RESULT_FILE.format(rank=rank)).read_text()))
                         for rank in range(ranks)])


def process_rank() -> tuple[int, int]:
    """(this process's rank, the processes of its launch): RANK and WORLD_SIZE under `accelerate launch`, else (0, 1)."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def process_device() -> str:
    """Where this process computes: its GPU (LOCAL_RANK's under `accelerate launch`), else the CPU."""
    import torch

    return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"


def worker(stage: str) -> ModuleType:
    """The module of `stage`'s worker side (imported now: hide what the job does not use first)."""
    return importlib.import_module(WORKERS[stage])


def dealer(stage: str) -> ModuleType:
    """The module that deals `stage`'s job to a Dask cluster (stages/processes/placement.py DaskCluster)."""
    return importlib.import_module(DEALERS[stage])


def run(job: Job, log: Callable[[str], None]) -> None:
    """Do `job` in this process, on its threads, and write the result it returns (RESULT_FILE). A
    damaged record it meets is also left in DAMAGED_RECORD_FILE, so that a parent in another process
    can raise it again (stages/processes/placement.py)."""
    job.work_dir.mkdir(parents=True, exist_ok=True)
    with torch_threads(job.threads) if job.threads else nullcontext():
        try:
            result = worker(job.stage).run_job(job, log)
        except Exception as error:
            from lorapipe.cache.samples import DamagedRecord

            if isinstance(error, DamagedRecord):
                write_json_atomic(job.work_dir / DAMAGED_RECORD_FILE, error.to_json())
            raise
    if result is not None:  # a rank with nothing to report (a training's other processes) returns none
        write_result(job.work_dir, result, process_rank()[0])


def run_reporting(job: Job) -> None:
    """Do `job` as a worker process does: its lines printed, an error reported in one line (`reporting_errors`)."""
    with reporting_errors(job.writes_into or job.work_dir):
        run(job, lambda line: print(line, flush=True))


def serve(hidden: list[str], warm_up: list[str]) -> None:
    """The warm process: see the module docstring."""
    hide(hidden)
    for stage in warm_up:
        getattr(worker(stage), "warm_up", lambda: None)()
    for line in sys.stdin:
        run_reporting(Job.read(Path(line.rstrip("\n"))))
        release_accelerator_memory()
        print(JOB_DONE, flush=True)


def release_accelerator_memory() -> None:
    """Between two jobs: free what the last one left on the GPU (its models' memory, which a
    reference cycle may hold until a collection), so the next one can load its own. On a CPU,
    freed by reference counting as usual, without a collection."""
    import torch

    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m lorapipe.stages.processes.jobs", description="run a stage's job")
    parser.add_argument("job", nargs="?", type=Path, help="the job file (without --serve)")
    parser.add_argument("--serve", action="store_true", help="read job paths on stdin, one a line")
    parser.add_argument("--hide", action="append", default=[], metavar="NAME", help="with --serve: hide a library")
    parser.add_argument("--warm-up", action="append", default=[], metavar="STAGE",
                        help="with --serve: import STAGE's worker before any job")
    args = parser.parse_args(argv)
    begin_worker()
    if args.serve:
        serve(args.hide, args.warm_up)
        return
    job = Job.read(args.job)
    hide(job.hidden)  # before the stage's module imports diffusers
    run_reporting(job)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    finally:
        skip_exit_collection()
