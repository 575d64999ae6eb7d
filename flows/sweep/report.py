"""STAND-IN until the sweep-report branch merges its real module over this one (SWEEP-DESIGN.md):
the names the sweep's flow calls, with a bare table for a report."""
from __future__ import annotations

import html
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .outcome import VariantOutcome


@dataclass(frozen=True)
class SweepReport:
    html: Path
    markdown: str


def _loss(split: str) -> Callable[[dict], float | None]:
    return lambda metrics: metrics.get("loss", {}).get(split, {}).get("lora", {}).get("overall")


# name -> (reader of metrics.json, higher is better)
METRICS: dict[str, tuple[Callable[[dict], float | None], bool]] = {
    "holdout_loss": (_loss("holdout"), False),
    "train_loss": (_loss("train"), False),
    "clip_score": (lambda metrics: (metrics.get("clip_score") or {}).get("lora"), True),
}


def score(outcome: VariantOutcome, metric: str) -> float | None:
    path = outcome.output_dir / "metrics.json" if outcome.output_dir else None
    if not outcome.succeeded or path is None or not path.is_file():
        return None
    return METRICS[metric][0](json.loads(path.read_text()))


def best_variant(outcomes: Sequence[VariantOutcome], metric: str) -> VariantOutcome | None:
    scored = [(score(o, metric), o) for o in outcomes]
    scored = [(s, o) for s, o in scored if s is not None]
    if not scored:
        return None
    pick = max if METRICS[metric][1] else min
    return pick(scored, key=lambda pair: pair[0])[1]


def write_sweep_report(outcomes: Sequence[VariantOutcome], out_dir: Path, metric: str) -> SweepReport:
    rows = [f"| {o.name} | {score(o, metric)} | {o.error or 'ok'} |" for o in outcomes]
    markdown = "\n".join([f"| variant | {metric} | outcome |", "|---|---|---|", *rows])
    page = out_dir / "sweep-report.html"
    page.write_text(f"<!doctype html><pre>{html.escape(markdown)}</pre>")
    return SweepReport(page, markdown)
