"""The caption stage's job (stages/processes/jobs.py): the missing records generated where its placement says
(stages/processes/placement.py): in one process, or shared among N processes under `accelerate launch`.

Rank r of N takes every N-th batch of the sorted record keys (generate.batches): a batch is the
same whatever the process count, so a sampled caption is too, and no two processes generate the
same record. Each commits its own shards and writes `left-out-<rank>.json` (the images it could
not read). No collective communication is needed.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from lorapipe.cache.fsutil import write_json_atomic
from lorapipe.cache.object_store import open_sample_store

from ..contract import Log
from ..processes.jobs import Job, process_rank
from ..processes.optional_libraries import OPTIONAL
from .generate import batches, generate_records
from .params import CaptionOptions, CaptionParams

if TYPE_CHECKING:
    from ..processes.placement import Placement
    from . import CaptionInputs


def generate_at(placement: Placement, todo: dict[str, dict], params: CaptionParams, inputs: CaptionInputs,
                options: CaptionOptions, work_dir: Path, log: Log) -> dict[str, dict]:
    """Generate the records of `todo` (record key -> a sample showing its image) where `placement`
    says; return the images left out (record key -> report row)."""
    for stale in work_dir.glob("left-out-*.json"):
        stale.unlink()
    if placement.processes > 1:
        log(f"caption: {placement.processes} processes, {len(todo)} images")
    spec = {"params": params.model_dump(mode="json"), "options": options.model_dump(mode="json"),
            "inputs": inputs.to_json(), "todo": todo}
    placement.run(Job("caption", spec, work_dir, placement.threads(None), OPTIONAL, inputs.cache_root), log)
    left_out: dict[str, dict] = {}
    for rank in range(placement.processes):
        left_out.update(json.loads((work_dir / f"left-out-{rank}.json").read_text()))
    return left_out


def run_job(job: Job, log: Log) -> None:
    """Generate this rank's batches of the job (stages/processes/jobs.py); write the images it left out into the work dir."""
    from . import CaptionInputs

    rank, world = process_rank()
    params, options = CaptionParams(**job.spec["params"]), CaptionOptions(**job.spec["options"])
    inputs, todo = CaptionInputs.from_json(job.spec["inputs"]), job.spec["todo"]
    mine = batches(list(todo), params.batch_size)[rank::world]
    log = (lambda m, log=log: log(f"[rank {rank}] {m}")) if rank else log
    if world > 1:
        log(f"caption: process {rank} of {world}: {sum(map(len, mine))} images")
    share = f" (rank {rank}'s share of {world})" if world > 1 else ""
    left_out = generate_records(mine, todo, params, inputs.model_path, inputs.prompt, inputs.datasets,
                                open_sample_store(inputs.cache_root), options, log, share)
    write_json_atomic(job.work_dir / f"left-out-{rank}.json", left_out)
