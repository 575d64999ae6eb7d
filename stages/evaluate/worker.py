"""The evaluate stage's job (stages/processes/jobs.py): its parent side writes it and reads back what it
built, wherever its placement runs it (stages/processes/placement.py): in this process, or in the warm
process, which has trained the LoRA with torch and diffusers imported, so that the command never
imports them. Either way on the threads one evaluate process uses, with the same files."""
from __future__ import annotations

import json
from pathlib import Path

from lorapipe.cache.fsutil import write_json_atomic
from lorapipe.cache.store import Built
from lorapipe.stages.contract import Log
from lorapipe.stages.processes.jobs import Job
from lorapipe.stages.processes.optional_libraries import OPTIONAL
from lorapipe.stages.processes.placement import Placement

from .params import EvalInputs, EvalOptions, EvalParams

BUILT = "built.json"  # what the job reports besides its files (lorapipe.cache.store.Built)


def evaluate_at(placement: Placement, params: EvalParams, inputs: EvalInputs, out_dir: Path, work_dir: Path,
                options: EvalOptions, log: Log) -> Built:
    """Evaluate where `placement` says, writing into out_dir."""
    spec = {"params": params.model_dump(mode="json"), "options": options.model_dump(mode="json"),
            "inputs": inputs.to_json(), "out_dir": str(Path(out_dir).resolve())}
    job = Job("evaluate", spec, Path(work_dir), placement.threads(options.cpu_threads), OPTIONAL, inputs.cache_root)
    (job.work_dir / BUILT).unlink(missing_ok=True)
    placement.run(job, log)
    return Built(**json.loads((job.work_dir / BUILT).read_text()))


def run_job(job: Job, log: Log) -> None:
    """Run the evaluation the job describes; write its Built into the work dir."""
    from .evaluation import run as evaluate

    spec = job.spec
    built = evaluate(EvalParams(**spec["params"]), EvalInputs.from_json(spec["inputs"]), Path(spec["out_dir"]),
                     job.work_dir, EvalOptions(**spec["options"]), log)
    write_json_atomic(job.work_dir / BUILT, {"info": built.info, "refs": built.refs})
