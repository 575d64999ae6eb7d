"""The caption stage's job (stages/processes/jobs.py): the missing records generated where its placement says
(stages/processes/placement.py): in one process, or shared among N processes under `accelerate launch`.

Rank r of N takes every N-th batch of the sorted record keys (generate.batches): a batch is the
same whatever the process count, so a sampled caption is too, and no two processes generate the
same record. Each commits its own shards and returns its share of the CaptionResult (the images it
could not read), which the job layer gathers. No collective communication is needed.
"""
from __future__ import annotations

from pathlib import Path

from lorapipe.cache.object_store import open_sample_store

from ..contract import Frozen, Log, json_form
from ..processes.jobs import Job, SplitResult, gather, process_rank
from ..processes.optional_libraries import OPTIONAL
from ..processes.placement import Placement, run_at
from . import CaptionInputs
from .generate import batches, generate_records
from .params import CaptionOptions, CaptionParams


class CaptionSpec(Frozen):
    params: CaptionParams
    options: CaptionOptions
    inputs: json_form(CaptionInputs)
    todo: dict[str, dict]  # record key -> a sample showing its image


class CaptionResult(SplitResult):
    left_out: dict[str, dict]  # record key -> the report row of an image that could not be read


def generate_at(placement: Placement, todo: dict[str, dict], params: CaptionParams, inputs: CaptionInputs,
                options: CaptionOptions, work_dir: Path, log: Log) -> dict[str, dict]:
    """Generate the records of `todo` (record key -> a sample showing its image) where `placement`
    says; return the images left out (record key -> report row)."""
    if placement.processes > 1:
        log(f"caption: {placement.processes} processes, {len(todo)} images")
    spec = CaptionSpec(params=params, options=options, inputs=inputs, todo=todo)
    run_at(placement, Job("caption", spec, work_dir, placement.threads(None), OPTIONAL, inputs.cache_root), log)
    return gather(work_dir, CaptionResult, placement.processes).left_out


def run_job(job: Job[CaptionSpec], log: Log) -> CaptionResult:
    """Generate this rank's batches of the job (stages/processes/jobs.py); return the images it left out."""
    rank, world = process_rank()
    params, options, inputs, todo = job.spec.params, job.spec.options, job.spec.inputs, job.spec.todo
    mine = batches(list(todo), params.batch_size)[rank::world]
    log = (lambda m, log=log: log(f"[rank {rank}] {m}")) if rank else log
    if world > 1:
        log(f"caption: process {rank} of {world}: {sum(map(len, mine))} images")
    share = f" (rank {rank}'s share of {world})" if world > 1 else ""
    return CaptionResult(left_out=generate_records(mine, todo, params, inputs.model_path, inputs.prompt,
                                                   inputs.datasets, open_sample_store(inputs.cache_root), options,
                                                   log, share))
