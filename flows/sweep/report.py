"""The comparison of a sweep's variants: each variant's score by a metric, the best one, and the
report: sweep-report.html (one self-contained file: settings, status, losses, the training curves
and per-checkpoint held-out losses overlaid, the sample grids side by side, the best marked) and
its markdown (the table and the best, for the Prefect artifact). Reads each variant's published
folder only (flows/sweep/scores.py), so it serves a sweep's flow and a look at old outputs alike."""
from __future__ import annotations

import html
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorapipe.cache.fsutil import write_text_atomic

from .outcome import VariantOutcome
from .report_page import Row, html_page
from .scores import base_holdout_loss, clip_score, holdout_loss, read_metrics, read_variant, train_loss

REPORT_HTML = "sweep-report.html"
Reader = Callable[[dict[str, Any]], float | None]  # metrics.json -> the metric, None when it lacks it
METRICS: dict[str, tuple[Reader, bool]] = {  # name -> (reader, higher is better)
    "holdout_loss": (holdout_loss, False),
    "train_loss": (train_loss, False),
    "clip_score": (clip_score, True),
}


@dataclass(frozen=True)
class SweepReport:
    html: Path  # sweep-report.html
    markdown: str  # the table and the best, for a Prefect markdown artifact
    best: VariantOutcome | None  # best_variant's pick, marked in both
    no_best: str | None  # why there is no best (None when there is one)


def score(outcome: VariantOutcome, metric: str) -> float | None:
    """The variant's `metric` from its metrics.json; None when it failed or lacks the metric."""
    reader, _ = _metric(metric)
    if not outcome.succeeded or outcome.output_dir is None:
        return None
    metrics = read_metrics(outcome.output_dir)
    return None if metrics is None else reader(metrics)


def best_variant(outcomes: Sequence[VariantOutcome], metric: str) -> VariantOutcome | None:
    """The variant with the best `metric` (the first of equals); None when no variant has it."""
    _, higher_is_better = _metric(metric)
    scored = [(value, outcome) for outcome in outcomes if (value := score(outcome, metric)) is not None]
    if not scored:
        return None
    pick = max if higher_is_better else min
    return pick(scored, key=lambda pair: pair[0])[1]


def write_sweep_report(outcomes: Sequence[VariantOutcome], out_dir: Path, metric: str,
                       shared: dict[str, Any] | None = None) -> SweepReport:
    """Write out_dir/sweep-report.html (replacing it in one rename) and return it with the markdown;
    `shared`: the --set values every variant has."""
    best = best_variant(outcomes, metric)
    rows = [Row(o, read_variant(o.output_dir if o.succeeded else None),  # a failed variant's files are not its result
                score(o, metric), o is best) for o in outcomes]
    no_best = None if best else _no_best(rows, metric)
    headline, table = _headline(rows, metric, no_best, shared or {}), _table(rows, metric)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out_dir / REPORT_HTML, html_page(rows, table, headline))
    return SweepReport(out_dir / REPORT_HTML, _markdown(table, headline), best, no_best)


def _metric(metric: str) -> tuple[Reader, bool]:
    if metric not in METRICS:
        raise ValueError(f"sweep.metric: {metric!r} is not one of {', '.join(METRICS)}")
    return METRICS[metric]


def _no_best(rows: list[Row], metric: str) -> str:
    if all(not row.outcome.succeeded for row in rows):
        return "every variant failed"
    return f"no variant's metrics.json has {metric}"


def _headline(rows: list[Row], metric: str, no_best: str | None, shared: dict[str, Any]) -> str:
    order = "higher" if METRICS[metric][1] else "lower"
    failed = sum(not row.outcome.succeeded for row in rows)
    best = next((row for row in rows if row.best), None)
    found = (f"best: {best.outcome.name} ({metric} {_number(best.score)})" if best
             else f"no best: {no_best}, so no best/ folder")
    every = "; ".join(f"{key}={_value(value)}" for key, value in shared.items())
    return (f"{len(rows)} variants ({failed} failed){f', each with {every}' if every else ''}; metric {metric}"
            f" ({order} is better); {found}.")


def _table(rows: list[Row], metric: str) -> tuple[list[str], list[list[str]]]:
    """(headers, plain text cells of each row): the overrides as columns, a CLIP column when a variant has it."""
    keys = list(dict.fromkeys(key for row in rows for key in row.outcome.overrides))
    with_clip = any(row.files.metrics and clip_score(row.files.metrics) is not None for row in rows)
    headers = ["best", "variant", *keys, "status", metric, "held-out loss, base", "held-out loss, LoRA",
               "held-out loss by checkpoint", *(["CLIP score, LoRA"] if with_clip else [])]
    table = []
    for row in rows:
        metrics = row.files.metrics or {}
        losses = [_number(read(metrics)) if metrics else "-" for read in (base_holdout_loss, holdout_loss)]
        table.append(["\u2605 best" if row.best else "", row.outcome.name,
                      *(_value(row.outcome.overrides[k]) if k in row.outcome.overrides else "" for k in keys),
                      "ok" if row.outcome.succeeded else f"failed: {row.outcome.error}", _number(row.score),
                      *losses, _checkpoints(row.files.checkpoints),
                      *([_number(clip_score(metrics)) if metrics else "-"] if with_clip else [])])
    return headers, table


def _value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.5f}"


def _checkpoints(checkpoints: dict[str, Any] | None) -> str:
    if checkpoints is None:
        return "-"
    if "skipped" in checkpoints:
        return f"skipped: {checkpoints['skipped']}"
    return "; ".join(f"step {c['step']}: {c['overall']:.5f}" for c in checkpoints["checkpoints"])


def _markdown(table: tuple[list[str], list[list[str]]], headline: str) -> str:
    headers, rows = table
    lines = ["# Sweep report", "", headline, "", _markdown_row(headers),
             "|---" * len(headers) + "|", *(_markdown_row(row) for row in rows),
             "", f"Training curves, per-checkpoint losses and sample grids: {REPORT_HTML} in the sweep's output"
             " folder."]
    return "\n".join(lines) + "\n"


def _markdown_row(cells: list[str]) -> str:
    """A table row, each cell on one line, its HTML and pipes escaped (an error line is text, not markup)."""
    return "| " + " | ".join(html.escape(" ".join(cell.split())).replace("|", "\\|") for cell in cells) + " |"
