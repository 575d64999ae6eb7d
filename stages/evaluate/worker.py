"""Evaluate's job in the process `lorapipe run` started ahead for training (stages/ahead.py): that
process has trained the LoRA with torch and diffusers imported, so the evaluation renders there,
on the threads the command's own process would use, and the command never imports them."""
from __future__ import annotations

import json
from pathlib import Path

from lorapipe.cache.fsutil import write_json_atomic
from lorapipe.cache.store import Built
from lorapipe.stages import ahead
from lorapipe.stages.contract import Log
from lorapipe.stages.cpu_threads import threads_per_process, torch_threads
from lorapipe.stages.launching import reporting_errors

from .params import EvalInputs, EvalOptions, EvalParams

WORKER = "lorapipe.stages.evaluate.worker"  # the module that runs evaluate's job
BUILT = "built.json"  # what the job reports besides its files (lorapipe.cache.store.Built)


def evaluate_in_process_started_ahead(params: EvalParams, inputs: EvalInputs, out_dir: Path, work_dir: Path,
                                      options: EvalOptions, log: Log) -> Built | None:
    """Evaluate in the process started ahead, writing into out_dir; None when there is none."""
    if not ahead.waiting():
        return None
    (work_dir / "logs").mkdir(parents=True, exist_ok=True)
    (work_dir / BUILT).unlink(missing_ok=True)
    job = work_dir / "evaluate-job.json"
    job.write_text(json.dumps({
        "params": params.model_dump(mode="json"), "options": options.model_dump(mode="json"),
        "inputs": inputs.to_json(), "out_dir": str(Path(out_dir).resolve()),
        "threads": threads_per_process(options.cpu_threads),
    }, sort_keys=True))
    if not ahead.run_lent("evaluate", WORKER, job, work_dir / "logs" / "evaluate.log", log):
        return None
    return Built(**json.loads((work_dir / BUILT).read_text()))


def run_job(job_path: Path) -> None:
    """Run the evaluation the job at `job_path` describes; write its Built next to the job."""
    from .evaluation import run as evaluate

    job = json.loads(job_path.read_text())
    inputs = EvalInputs.from_json(job["inputs"])
    with reporting_errors(inputs.cache_root), torch_threads(job["threads"]):
        built = evaluate(EvalParams(**job["params"]), inputs, Path(job["out_dir"]), job_path.parent,
                         EvalOptions(**job["options"]), lambda line: print(line, flush=True))
    write_json_atomic(job_path.parent / BUILT, {"info": built.info, "refs": built.refs})
