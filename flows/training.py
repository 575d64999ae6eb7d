"""Train's own ways of running, besides serving or building its key (flows/runner.py): joining a
training across machines from machine rank > 0, and a warm start from this pipeline's previous LoRA
(the `retrain` deployment). The train task (flows/pipeline.py) picks among them. No Prefect here.
"""
from __future__ import annotations

import time
from pathlib import Path

from lorapipe.cache.errors import UserError
from lorapipe.cache.store import Artifact
from lorapipe.stages import train
from lorapipe.stages.lora_formats.lora_folder import LORA_FILE

from .config import PipelineConfig, split
from .steps import Context, step_for
from .runner import StageResult, run_stage


def machine_rank(config: PipelineConfig) -> int:
    """This machine's rank in a training across machines (0 on one machine)."""
    return train.machines(*split(config.train, train.TrainParams, train.TrainOptions)).rank


def machine_folder(output_dir: Path, rank: int) -> Path:
    """Where machine rank > 0 keeps its training job, its log and its run summary: it publishes
    no stage files, so a run there never touches what rank 0 publishes into a shared output_dir."""
    return output_dir / f"train-machine-{rank}"


def follow_train(ctx: Context, upstream: dict[str, Artifact], run: bool = True) -> tuple[StageResult, None]:
    """Train on machine rank > 0: this machine's processes join rank 0's training. Rank 0 holds the
    work directory's lock, checkpoints and publishes, so this takes no lock, reads no checkpoint
    and publishes nothing (--force matters on rank 0 only); its job and log go into
    output_dir/train-machine-N/."""
    if not run:
        raise UserError("train.machine_rank > 0 only joins a training: select train (drop --only/--from that skip it)")
    started, step = time.time(), step_for("train", ctx, upstream)
    rank = machine_rank(ctx.config)
    ctx.log(f"train: machine rank {rank} joins machine rank 0's training of {step.key.key[:12]}")
    step.follow(machine_folder(ctx.config.output_dir, rank))
    result = StageResult("train", "joined", step.key.key, "", "(published by machine rank 0)",
                         round(time.time() - started, 3), f"machine rank {rank}: rank 0 publishes and evaluates")
    return result, None


def previous_train(ctx: Context) -> Artifact:
    """This pipeline's last train artifact: where a warm start begins."""
    previous = ctx.store.previous(ctx.config.name, "train")
    found = ctx.store.lookup("train", previous["key"]) if previous else None
    if not found or not found.hit:
        raise UserError(f"warm_start: pipeline {ctx.config.name!r} has no earlier LoRA in {ctx.config.cache_dir};"
                        " run it once without warm_start")
    return found.artifact


def run_warm_train(ctx: Context, upstream: dict[str, Artifact], **kwargs) -> tuple[StageResult, Artifact]:
    """Train starting from the previous LoRA. When that LoRA was trained on exactly this encoded
    data there is nothing new to learn, so it is served as is (a scheduled no-op stays a no-op)."""
    started, previous = time.time(), previous_train(ctx)
    if previous.manifest["ingredients"]["inputs"]["encode"] == upstream["encode"].digest:
        reason = "warm start on unchanged data: the previous LoRA stands"
        ctx.log(f"train: hit ({reason}) {previous.location}")
        return StageResult("train", "hit", previous.key, previous.digest, str(previous.location),
                           round(time.time() - started, 3), reason), previous
    ctx.log(f"train: warm start from {previous.path / LORA_FILE}")
    train_settings = ctx.config.train.model_copy(update={"init_lora": str(previous.path / LORA_FILE)})
    warm = Context(ctx.config.model_copy(update={"train": train_settings}), ctx.log, placements=ctx.placements)
    try:
        return run_stage(warm, "train", upstream, **kwargs)
    finally:
        warm.close()
