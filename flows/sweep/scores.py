"""What a variant's published folder says about it (a `lorapipe run` output folder): evaluate's
metrics.json and checkpoint_losses.json, train's loss log and the sample grid, each None or empty
when the folder lacks it (a failed variant, a run that did not evaluate)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorapipe.stages.evaluate.params import ANIMATED_GRID, CHECKPOINT_LOSSES, GRID, METRICS
from lorapipe.stages.train.params import LOSS_LOG

CURVE_POINTS = 300  # a training curve longer than this is averaged over bins of steps: smoother, a smaller page


@dataclass(frozen=True)
class VariantFiles:
    metrics: dict[str, Any] | None  # metrics.json
    checkpoints: dict[str, Any] | None  # checkpoint_losses.json
    curve: list[tuple[float, float]]  # (step, training loss), averaged down to CURVE_POINTS
    grid: Path | None  # the sample grid: the same prompts and seeds in every variant


def read_variant(folder: Path | None) -> VariantFiles:
    if folder is None:
        return VariantFiles(None, None, [], None)
    grid = next((folder / name for name in (ANIMATED_GRID, GRID) if (folder / name).is_file()), None)
    return VariantFiles(read_metrics(folder), _json(folder / CHECKPOINT_LOSSES), training_curve(folder / LOSS_LOG),
                        grid)


def read_metrics(folder: Path) -> dict[str, Any] | None:
    return _json(folder / METRICS)


def _json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def training_curve(loss_log: Path) -> list[tuple[float, float]]:
    """(step, loss) of each row of train's loss log, as (mean step, mean loss) of consecutive bins
    when there are more than CURVE_POINTS rows; [] without a log."""
    if not loss_log.is_file():
        return []
    rows = [json.loads(line) for line in loss_log.read_text().splitlines() if line]
    size = -(-len(rows) // CURVE_POINTS)  # rows per bin
    bins = [rows[i:i + size] for i in range(0, len(rows), size)]
    return [(sum(r["step"] for r in b) / len(b), sum(r["loss"] for r in b) / len(b)) for b in bins]


def holdout_loss(metrics: dict[str, Any]) -> float | None:
    """The LoRA's denoising loss on the held-out split (lower is better)."""
    return _lora_loss(metrics, "holdout")


def train_loss(metrics: dict[str, Any]) -> float | None:
    """The LoRA's denoising loss on (a fixed subset of) the training split, as evaluate scores it
    with fixed noise: comparable across variants, unlike the noisy per-step loss of the log."""
    return _lora_loss(metrics, "train")


def _lora_loss(metrics: dict[str, Any], split: str) -> float | None:
    lora = metrics["loss"].get(split, {}).get("lora")
    return None if lora is None else lora["overall"]


def base_holdout_loss(metrics: dict[str, Any]) -> float | None:
    base = metrics["loss"].get("holdout", {}).get("base")
    return None if base is None else base["overall"]


def clip_score(metrics: dict[str, Any]) -> float | None:
    """The LoRA's best CLIP score over evaluate.lora_scales (higher is better); None when skipped."""
    by_scale = metrics.get("clip_score", {}).get("lora")
    return max(by_scale.values()) if by_scale else None
