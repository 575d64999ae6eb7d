"""The parent side of training: launch the recipe under accelerate, stream its log, publish.

The child processes write only into work_dir; once they succeed, the parent copies the results
into out_dir. Interrupting the parent (Ctrl-C, a Prefect cancel) terminates every child. A
child that meets a damaged record leaves it in work_dir/damaged-record.json and the parent
raises it as cache.samples.DamagedRecord, which the flow repairs (flows/runner.py).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from cache.samples import DamagedRecord
from cache.store import Built
from stages import families
from stages.contract import Log
from stages.encoded import EncodedData
from stages.launching import WorkerFailed, run_streaming, write_accelerate_config
from stages.train.checkpoints import LORA_FILE, CheckpointDir, step_name
from stages.train.params import DAMAGED_RECORD_FILE, TRACKER_RUN, TrainInputs, TrainOptions, TrainParams



def run(params: TrainParams, inputs: TrainInputs, out_dir: Path, work_dir: Path,
        options: TrainOptions | None = None, log: Log = print) -> Built:
    """Train (or resume training) in work_dir, then publish the LoRA files into out_dir."""
    options = options or TrainOptions()
    out_dir, work_dir = Path(out_dir), Path(work_dir)
    check_inputs(params, inputs)
    (work_dir / "logs").mkdir(parents=True, exist_ok=True)
    config = write_accelerate_config(work_dir / "accelerate.yaml", params.num_processes)
    job = work_dir / "job.json"
    job.write_text(json.dumps({
        "params": params.model_dump(mode="json"), "inputs": inputs.to_json(),
        "options": options.model_dump(mode="json"), "work_dir": str(work_dir.resolve()),
    }, indent=1, sort_keys=True))
    threads = max(1, (os.cpu_count() or 1) // params.num_processes)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
               "--num_cpu_threads_per_process", str(threads), "-m", "stages.train.recipe", str(job)]
    log(f"train: {params.num_processes} process(es), {params.max_steps} steps, work dir {work_dir}")
    damaged = work_dir / DAMAGED_RECORD_FILE
    damaged.unlink(missing_ok=True)
    try:
        run_streaming(command, work_dir / "logs" / "train.log", log)
    except WorkerFailed as failure:
        if damaged.is_file():
            raise DamagedRecord.from_json(json.loads(damaged.read_text())) from failure
        raise
    return publish(work_dir, out_dir, params.max_steps, log)


def check_inputs(params: TrainParams, inputs: TrainInputs) -> None:
    """Before anything starts: the encoded data was made by this model's encoders, and every
    objective setting applies to its family (one line naming the key otherwise)."""
    family = families.for_model(inputs.model_path)
    EncodedData(inputs.encoded_dir, inputs.cache_root).check_model(inputs.model_path, family.name,
                                                                   inputs.model_digests)
    family.check_objective(params)


def publish(work_dir: Path, out_dir: Path, max_steps: int, log: Log) -> Built:
    """Copy the exported files (the family's LoRA formats, train_config.json), every retained
    checkpoint's LoRA weights and the logs into out_dir."""
    for exported in sorted((work_dir / "export").iterdir()):
        _copy(exported, out_dir / exported.name)
    checkpoints = CheckpointDir(work_dir / "checkpoints")
    for step in checkpoints.steps():
        problem = checkpoints.damage(step)
        if problem:
            log(f"train: not publishing {step_name(step)}: {problem}")
            continue
        _copy(checkpoints.path(step) / LORA_FILE, out_dir / "checkpoints" / step_name(step) / LORA_FILE)
    for name in ("loss.jsonl", "loss.png", "train.log", "summary.json"):
        _copy(work_dir / "logs" / name, out_dir / "logs" / name)
    if (work_dir / "logs" / TRACKER_RUN).is_dir():
        shutil.copytree(work_dir / "logs" / TRACKER_RUN, out_dir / "logs" / TRACKER_RUN, dirs_exist_ok=True)
    losses = [json.loads(line) for line in (work_dir / "logs" / "loss.jsonl").read_text().splitlines() if line]
    summary = json.loads((work_dir / "logs" / "summary.json").read_text())
    final = [e["loss"] for e in losses if e["step"] == max_steps]
    return Built(info={"steps": summary["steps"], "final_loss": final[-1] if final else None,
                       "resumed_from": summary["resumed_from"]})


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    os.chmod(dst, 0o644)
