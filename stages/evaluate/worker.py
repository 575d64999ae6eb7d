"""The evaluate stage's job (stages/processes/jobs.py): its parent side writes it and reads back what it
built, wherever its placement runs it (stages/processes/placement.py): in this process, or in the warm
process, which has trained the LoRA with torch and diffusers imported, so that the command never
imports them. Either way on the threads one evaluate process uses, with the same files."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from lorapipe.cache.store import Built
from lorapipe.stages.contract import Frozen, Log, json_form
from lorapipe.stages.processes.jobs import Job, JobResult, gather
from lorapipe.stages.processes.optional_libraries import OPTIONAL
from lorapipe.stages.processes.placement import Placement, run_at

from .params import EvalInputs, EvalOptions, EvalParams


class EvalSpec(Frozen):
    params: EvalParams
    options: EvalOptions
    inputs: json_form(EvalInputs)
    out_dir: Path  # resolved: the job may run in another process


class EvalResult(JobResult):
    """What the job reports besides its files (lorapipe.cache.store.Built)."""

    info: dict[str, Any]
    refs: dict[str, dict[str, Any]]


def evaluate_at(placement: Placement, params: EvalParams, inputs: EvalInputs, out_dir: Path, work_dir: Path,
                options: EvalOptions, log: Log) -> Built:
    """Evaluate where `placement` says, writing into out_dir."""
    spec = EvalSpec(params=params, options=options, inputs=inputs, out_dir=Path(out_dir).resolve())
    job = Job("evaluate", spec, Path(work_dir), placement.threads(options.cpu_threads), OPTIONAL, inputs.cache_root)
    run_at(placement, job, log)
    result = gather(job.work_dir, EvalResult)
    return Built(result.info, result.refs)


def run_job(job: Job[EvalSpec], log: Log) -> EvalResult:
    """Run the evaluation the job describes; return its Built."""
    from .evaluation import run as evaluate

    spec = job.spec
    built = evaluate(spec.params, spec.inputs, spec.out_dir, job.work_dir, spec.options, log)
    return EvalResult(info=built.info, refs=built.refs)
