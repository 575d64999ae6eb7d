"""A training shorter than the one its work directory holds: max_steps lowered after a longer run,
or a sweep over max_steps in any order.

The work directory is keyed without max_steps (raising it resumes), so it may hold checkpoints past
this run's last step. They belong to the longer training, which a later run may extend: nothing of
it is removed or changed. This run trains in a folder of its own inside the work directory,
`shorter/max-steps-XXXXXX/` (mirrored, kept and removed with it; gone once the LoRA is published),
starting from the longer training's checkpoints at or before its last step where that is exact.

Exact: a step's data, noise and randomness depend on its index alone (recipe.py), so a checkpoint
of step k is step k of a training of any length, unless the lr schedule depends on max_steps
(TOTAL_DEPENDENT_SCHEDULES): then every step of a longer training had other learning rates, and
this run starts from scratch. A checkpoint at max_steps itself is the result: it is exported as is.
"""
from __future__ import annotations

import json
from pathlib import Path

from lorapipe.cache.fsutil import remove_tree, write_text_atomic
from lorapipe.stages.contract import Log
from lorapipe.stages.lora_formats.lora_folder import step_name
from lorapipe.stages.train.checkpoints import CheckpointDir
from lorapipe.stages.train.params import LOSS_LOG, TOTAL_DEPENDENT_SCHEDULES, TrainParams

SHORTER_DIR = "shorter"


def training_dir(work_dir: Path, params: TrainParams, log: Log) -> Path:
    """Where this training runs: `work_dir`, unless that holds a checkpoint past max_steps; then
    its own folder, begun from the longer training's checkpoints where exact (the log says which)."""
    longer = CheckpointDir(work_dir / "checkpoints")
    past = [step for step in longer.steps() if step > params.max_steps]
    if not past:
        return work_dir
    own = work_dir / SHORTER_DIR / f"max-steps-{params.max_steps:06d}"
    held = f"train: {work_dir} holds a longer training (to {step_name(past[-1])}), left as it is;"
    if CheckpointDir(own / "checkpoints").steps():
        log(f"{held} resuming this {params.max_steps}-step training in {own}")
        return own
    if params.lr_scheduler in TOTAL_DEPENDENT_SCHEDULES:
        log(f"{held} lr_scheduler {params.lr_scheduler} depends on max_steps, so none of its checkpoints is a step"
            f" of a {params.max_steps}-step training: training from scratch in {own}")
        return own
    start = begin_from(longer, work_dir / LOSS_LOG, own, params, log)
    if start is None:
        log(f"{held} it kept no intact checkpoint at or before step {params.max_steps}: training from scratch in {own}")
    elif start == params.max_steps:
        log(f"{held} its {step_name(start)} is this training's result (lr_scheduler {params.lr_scheduler} does not"
            f" depend on max_steps): exporting it from {own}")
    else:
        log(f"{held} training from its {step_name(start)} in {own} (exact: lr_scheduler {params.lr_scheduler} does"
            " not depend on max_steps)")
    return own


def begin_from(longer: CheckpointDir, loss_log: Path, own: Path, params: TrainParams, log: Log) -> int | None:
    """Copy into `own` the intact checkpoints of `longer` that a training straight to max_steps
    would keep (checkpoints.rotate's rule), and the loss log up to the newest; returns its step."""
    n = params.max_steps
    wanted = [s for s in longer.steps() if s <= n and (s % params.checkpoint_every == 0 or s == n)]
    intact = []
    for step in wanted[-params.keep_checkpoints:]:
        problem = longer.damage(step)
        if problem:
            log(f"train: not starting from {step_name(step)}: {problem}")
        else:
            intact.append(step)
    if not intact:
        return None
    rows = loss_log.read_text().splitlines() if loss_log.is_file() else []
    (own / LOSS_LOG).parent.mkdir(parents=True, exist_ok=True)
    kept = [row for row in rows if row and json.loads(row)["step"] <= intact[-1]]
    write_text_atomic(own / LOSS_LOG, "".join(f"{row}\n" for row in kept))
    for step in intact:  # the loss log first: a copy cut short leaves fewer checkpoints, never rows missing
        longer.copy_into(CheckpointDir(own / "checkpoints"), step)
    return intact[-1]


def drop_own_dir(work_dir: Path, trained_in: Path) -> None:
    """Once its files are published, drop a shorter training's own folder (the longer one's stays)."""
    if trained_in == work_dir:
        return
    remove_tree(trained_in)
    if not any(trained_in.parent.iterdir()):
        trained_in.parent.rmdir()
