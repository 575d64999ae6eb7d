"""The parent side of training: the training job (stages/processes/jobs.py) run where its placement says
(stages/processes/placement.py: a process of its own, the warm process, or `accelerate launch`), then publish.

The training processes write only into work_dir; once they succeed, the parent copies the results
into out_dir. Interrupting the parent (Ctrl-C, a Prefect cancel) terminates every one of them. A
damaged record one meets is raised here as lorapipe.cache.samples.DamagedRecord, which the flow
repairs (flows/runner.py).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

import yaml

from lorapipe.cache.errors import UserError
from lorapipe.cache.store import Built
from lorapipe.stages import families
from lorapipe.stages.contract import Log
from lorapipe.stages.encoded import EncodedData
from lorapipe.stages.processes.jobs import Job, gather
from lorapipe.stages.processes.launching import Interrupted
from lorapipe.stages.processes.optional_libraries import OPTIONAL
from lorapipe.stages.processes.placement import Machines, Placement, Where, place, run_at
from lorapipe.stages.lora_formats.lora_folder import LORA_FILE, checkpoint_lora, expert_file, step_name
from lorapipe.stages.train.checkpoints import CheckpointDir
from lorapipe.stages.train.params import TRACKER_RUN, TrainInputs, TrainOptions, TrainParams, TrainResult, TrainSpec
from lorapipe.stages.train.quantization import LIBRARY
from lorapipe.stages.train.shorter import drop_own_dir, training_dir


def run(params: TrainParams, inputs: TrainInputs, out_dir: Path, work_dir: Path,
        options: TrainOptions | None = None, log: Log = print, placement: Placement | None = None) -> Built:
    """Train (or resume training) in work_dir where `placement` says (the plan's; default: what
    `where` says), then publish the LoRA files into out_dir. A training shorter than the one
    work_dir holds runs in a folder of its own (stages/train/shorter.py). On several machines
    this is machine rank 0's part; the others run `follow`."""
    options = options or TrainOptions()
    out_dir, work_dir = Path(out_dir), Path(work_dir)
    if machines(params, options).rank:
        raise RuntimeError("only machine rank 0 publishes: the other machines run lorapipe.stages.train.launch.follow")
    warn_if_distilled(check_inputs(params, inputs, options), inputs.model_path, log)
    trained_in = training_dir(work_dir, params, log)
    launch(params, inputs, trained_in, options, log, lambda: interrupted_at(trained_in), placement)
    built = publish(trained_in, out_dir, params.max_steps, log)
    drop_own_dir(work_dir, trained_in)
    return built


def follow(params: TrainParams, inputs: TrainInputs, work_dir: Path, options: TrainOptions, log: Log = print,
           placement: Placement | None = None) -> None:
    """Machine rank > 0's part of a training across machines: run this machine's processes (they
    join rank 0's, read the encoded data from the same cache and receive a resumed state from rank 0);
    work_dir, private to this machine, holds only their job and log. Rank 0 checkpoints and publishes."""
    nodes = machines(params, options)
    check_inputs(params, inputs, options)
    launch(params, inputs, Path(work_dir), options, log,
           lambda: f"training interrupted on machine rank {nodes.rank}: machine rank 0's checkpoints say where"
                   " a rerun (on every machine) resumes", placement)
    log(f"train: machine rank {nodes.rank} of {nodes.count} done; machine rank 0 publishes the LoRA and evaluates it")


def launch(params: TrainParams, inputs: TrainInputs, work_dir: Path, options: TrainOptions, log: Log,
           interrupted: Callable[[], str], placement: Placement | None = None) -> None:
    """Run this machine's training processes to the end where `placement` says, streaming their
    log. `interrupted` says what Ctrl-C leaves."""
    placement = placement or place(where(params, options))
    spec = TrainSpec(params=params, inputs=inputs, options=options)
    job = Job("train", spec, work_dir.resolve(), placement.threads(options.cpu_threads), unused_libraries(params))
    log(f"train: {params.num_processes} process(es) of {job.threads} thread(s) {placement.describe()},"
        f" {params.max_steps} steps, work dir {work_dir}")
    try:
        run_at(placement, job, log)
    except KeyboardInterrupt:
        raise Interrupted(interrupted()) from None


def where(params: TrainParams, options: TrainOptions) -> Where:
    """Where training runs (stages/processes/placement.py): under the user's accelerate config
    (`train.accelerate_config`, else `accelerate config`'s default file when there is one), or one
    written for DDP; one process without one runs in a process of its own, sparing the launcher's
    own interpreter and imports (BENCHMARKS.md, start-up). num_processes counts every machine's."""
    return Where(params.num_processes, user_accelerate_config(options.accelerate_config), machines(params, options),
                 own_process=True)


def check_inputs(params: TrainParams, inputs: TrainInputs, options: TrainOptions) -> families.Family:
    """Before anything starts: the encoded data was made by this model's encoders, train.denoiser
    names one of its denoisers where it has several, every objective setting applies to its
    family, prior settings have prior samples to apply to, and block swap and compile can apply
    (one line naming the key otherwise). Returns the family."""
    family = families.for_model(inputs.model_path)
    if len(family.trained_denoisers(params.denoiser)) > 1 and params.init_lora:
        raise UserError(f"train.init_lora: one file cannot start train.denoiser {params.denoiser}'s several LoRAs;"
                        " remove it, or train one denoiser")
    data = EncodedData(inputs.encoded_dir, inputs.cache_root)
    data.check_model(inputs.model_path, family.name, inputs.model_digests)
    family.check_objective(params)
    check_prior_settings(params, data)
    check_block_swap(family, params, options)
    check_compile(family, options)
    return family


def check_block_swap(family: families.Family, params: TrainParams, options: TrainOptions) -> None:
    """Refuse, in one line naming the key, train.blocks_to_swap where it cannot apply (no model file read)."""
    setting = options.blocks_to_swap
    if setting is None:
        return
    if not family.block_lists:
        raise UserError(f"train.blocks_to_swap: {family.label}'s denoiser has no chain of blocks to swap; remove it")
    if params.base_quantization != "none":
        raise UserError(f"train.blocks_to_swap: not with train.base_quantization {params.base_quantization}: a"
                        " quantised weight cannot be swapped in and out yet; use one or the other")
    if params.init != "default":
        raise UserError(f"train.blocks_to_swap: not with train.init {params.init}, which rewrites the base weights"
                        " at every checkpoint; use init default")


def check_compile(family: families.Family, options: TrainOptions) -> None:
    """Refuse, in one line naming the key, train.compile where it cannot apply (no model file read)."""
    if not options.compile:
        return
    if not family.block_lists:
        raise UserError(f"train.compile: {family.label}'s denoiser has no chain of blocks to compile; remove it")
    if options.blocks_to_swap is not None:
        raise UserError("train.compile: not with train.blocks_to_swap, whose hooks move a block's weights while it"
                        " runs, which a compiled block cannot follow; use one or the other")
    import torch

    compiler = os.environ.get("CXX", "g++")  # what torch's inductor calls to build CPU kernels
    if not torch.cuda.is_available() and not shutil.which(compiler):
        raise UserError(f"train.compile: torch compiles CPU kernels with a C++ compiler and {compiler} is not on the"
                        " PATH: install one (apt-get install g++), set CXX to yours, or remove train.compile")


def check_prior_settings(params: TrainParams, data: EncodedData) -> None:
    """A prior setting changed from its default with no prior sample to train on would be keyed yet do nothing."""
    changed = [name for name in ("prior_loss_weight", "prior_target")
               if getattr(params, name) != TrainParams.model_fields[name].default]
    if changed and not any(sample.role == "prior" for sample in data.split("train")):
        raise UserError(f"train.{changed[0]}: no training image comes from a dataset with role: prior; add one"
                        " (data.datasets: [..., {path: ..., role: prior}]) or leave the setting out")


def warn_if_distilled(family: families.Family, model_path: Path, log: Log) -> None:
    """Once per run, in the launching process: a LoRA trained on a step-distilled checkpoint breaks
    its distillation (the images collapse); the family names the base to train on instead."""
    base = family.variant.train_instead
    if base:
        log(f"train: warning: {model_path} is a distilled {family.label} checkpoint; a LoRA trained on it undoes"
            f" the distillation and its images collapse: train on the base model, {base}, and preview on this one"
            " with evaluate.render_model")


def interrupted_at(work_dir: Path) -> str:
    """How far an interrupted training got, and where a rerun resumes (checkpoints are committed
    atomically, so the last one stands whenever the interrupt came)."""
    loss_log = work_dir / "logs" / "loss.jsonl"
    lines = loss_log.read_text().splitlines() if loss_log.is_file() else []
    step = next((row["step"] for row in map(_json_or_none, reversed(lines)) if row), 0)
    checkpoints = CheckpointDir(work_dir / "checkpoints").steps()
    resume = f"from its last checkpoint, {step_name(checkpoints[-1])}" if checkpoints else "(no checkpoint yet: from the start)"
    return f"training interrupted at step {step}; run again to resume {resume}"


def _json_or_none(line: str) -> dict | None:
    try:
        return json.loads(line)
    except ValueError:  # the line the interrupt cut short
        return None


def unused_libraries(params: TrainParams) -> tuple[str, ...]:
    """The optional libraries (stages/processes/optional_libraries.py) a training with `params` never calls."""
    used = {LIBRARY.get(params.base_quantization), "bitsandbytes" if params.optimizer == "adamw8bit" else None}
    return tuple(name for name in OPTIONAL if name not in used)


def machines(params: TrainParams, options: TrainOptions) -> Machines:
    """train.num_machines > 1 with its machine_rank, main_process_ip and main_process_port, else what
    the user's accelerate config says (accelerate reads it too), else one machine. num_processes
    counts the processes of every machine, so it must be a multiple of their number."""
    if options.num_machines > 1:
        found = Machines(options.num_machines, options.machine_rank, (
            "--num_machines", str(options.num_machines), "--machine_rank", str(options.machine_rank),
            "--main_process_ip", str(options.main_process_ip), "--main_process_port", str(options.main_process_port)))
        where = "train.num_machines"
    else:
        config = user_accelerate_config(options.accelerate_config)
        values = (yaml.safe_load(config.read_text()) or {}) if config else {}
        found = Machines(int(values.get("num_machines") or 1), int(values.get("machine_rank") or 0))
        where = f"num_machines in {config}"
    if params.num_processes % found.count:
        raise UserError(f"train.num_processes: {params.num_processes} processes cannot be spread evenly over"
                        f" {found.count} machines ({where}): use a multiple of {found.count}")
    return found


def user_accelerate_config(accelerate_config: str | None) -> Path | None:
    """train.accelerate_config (which must exist), else accelerate's default file if there is one."""
    config = Path(accelerate_config) if accelerate_config else default_accelerate_config()
    if config is not None and not config.is_file():
        raise UserError(f"train.accelerate_config: {config} is not a file; write one with `accelerate config"
                        f" --config_file {config}` or leave the key out")
    return config


def default_accelerate_config() -> Path | None:
    """`accelerate config`'s default file, if it exists, where accelerate looks for it
    (accelerate.commands.config.config_args, not imported here: it loads torch)."""
    home = os.environ.get("HF_HOME", os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"))
    default = Path(home).expanduser() / "accelerate" / "default_config.yaml"
    return default if default.is_file() else None


def publish(work_dir: Path, out_dir: Path, max_steps: int, log: Log) -> Built:
    """Copy the exported files (the family's LoRA formats, with an EMA also in ema/; train_config.json), every retained
    checkpoint's LoRA weights and the logs into out_dir."""
    export = work_dir / "export"
    for exported in sorted(f for f in export.rglob("*") if f.is_file()):  # ema/: the averaged adapter's files
        _copy(exported, out_dir / exported.relative_to(export))
    checkpoints = CheckpointDir(work_dir / "checkpoints")
    for step in checkpoints.steps():
        problem = checkpoints.damage(step)
        if problem:
            log(f"train: not publishing {step_name(step)}: {problem}")
            continue
        for lora in sorted(checkpoints.path(step).glob(f"**/{LORA_FILE}")):  # each denoiser's, in its folder
            denoiser = "" if lora.parent == checkpoints.path(step) else lora.parent.name
            _copy(lora, checkpoint_lora(out_dir, step).with_name(expert_file(LORA_FILE, denoiser)))
    for name in ("loss.jsonl", "loss.png", "train.log", "summary.json"):
        _copy(work_dir / "logs" / name, out_dir / "logs" / name)
    if (work_dir / "logs" / TRACKER_RUN).is_dir():
        shutil.copytree(work_dir / "logs" / TRACKER_RUN, out_dir / "logs" / TRACKER_RUN, dirs_exist_ok=True)
    losses = [json.loads(line) for line in (work_dir / "logs" / "loss.jsonl").read_text().splitlines() if line]
    result = gather(work_dir, TrainResult)
    final = [e["loss"] for e in losses if e["step"] == max_steps]
    return Built(info={"steps": result.steps, "final_loss": final[-1] if final else None,
                       "resumed_from": result.resumed_from})


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    os.chmod(dst, 0o644)
