"""The best variant's files published into output_dir/best/, as `lorapipe run` publishes a run
(flows/outputs.py: the same files, run-summary.json last), with best/sweep-variant.json saying
which variant it is and why (name, overrides, the sweep's shared --set values, metric, score).
sweep-variant.json is removed before the files change and written, atomically, after: whenever it
exists it describes the files beside it. A sweep without a best removes the folder: an earlier
sweep's best would contradict its report. No Prefect here."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lorapipe.cache.fsutil import remove_tree, write_json_atomic

from ..config import PipelineConfig
from ..outputs import SUMMARY_FILE, finish_run
from ..runner import StageResult
from .outcome import VariantOutcome

BEST_FILE = "sweep-variant.json"


def publish_best(best: VariantOutcome, config: PipelineConfig, out: Path, metric: str, score: float,
                 shared: dict[str, Any], log: Callable[[str], None]) -> None:
    """Publish the files of `best` (trained with `config`) into `out`, from the artifacts its own
    run summary names (not from its folder, which a later sweep may be rewriting)."""
    summary = json.loads((best.output_dir / SUMMARY_FILE).read_text())
    results = [StageResult(**row) for row in summary["stages"]]
    (out / BEST_FILE).unlink(missing_ok=True)
    finish_run(out, config, results, summary["run"], log, record=False)
    write_json_atomic(out / BEST_FILE, {"name": best.name, "overrides": best.overrides, "shared_settings": shared,
                                        "metric": metric, "score": score})
    log(f"best: variant {best.name} ({metric} {score}) published into {out}")


def withdraw_best(out: Path, why: str, log: Callable[[str], None]) -> None:
    """Remove `out`, an earlier sweep's best, when this sweep has none (`why`); its files stay in
    that variant's folder and the cache."""
    if out.exists():
        remove_tree(out)  # renamed aside first: never a best/ without its sweep-variant.json
        log(f"best: none ({why}); removed {out}, an earlier sweep's best")
