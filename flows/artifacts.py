"""What a run shows in the Prefect UI besides its logs: progress bars for encode and train, a
table of the stages (hit or computed, key, duration) and the evaluation report.

The stages stay Prefect-free: progress is read from the log lines they already print.
"""
from __future__ import annotations

import re
import time
from pathlib import Path
from uuid import UUID

from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact

from lorapipe.cache.store import LOG_DIR
from lorapipe.stages.caption.review import REVIEW_MD
from lorapipe.stages.evaluate.params import REPORT
from lorapipe.stages.evaluate.report import embed_images

from .runner import StageResult

PROGRESS_LINES = {  # stage -> the log line that says how far it is: (done, total)
    "encode": re.compile(r"^encode: latents (\d+)/(\d+)\b"),
    "train": re.compile(r"^step (\d+)/(\d+) "),  # the line goes on with the loss, rate and ETA
}
UPDATE_EVERY = 1.0  # seconds: the most often one progress artifact is written (a fast log would flood the API)


class StageProgress:
    """A progress artifact for one stage run, moved by the stage's own log lines; its description
    is the latest of those lines (for train: step, loss, learning rate, it/s and ETA)."""

    def __init__(self, stage: str):
        self.stage, self.pattern = stage, PROGRESS_LINES.get(stage)
        self.artifact_id: UUID | None = None
        self.updated = float("-inf")

    def __call__(self, line: str) -> None:
        match = self.pattern.match(line) if self.pattern else None
        if not match:
            return
        done, total = int(match[1]), max(1, int(match[2]))
        now = time.monotonic()
        if done < total and now - self.updated < UPDATE_EVERY:
            return
        percent = min(100.0, round(100 * done / total, 1))
        description = line if line.startswith(f"{self.stage}:") else f"{self.stage}: {line}"
        if self.artifact_id is None:
            self.artifact_id = create_progress_artifact(percent, description=description)
        else:
            update_progress_artifact(self.artifact_id, percent, description=description)
        self.updated = now


def artifact_key(pipeline: str, what: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{pipeline}-{what}".lower())


def publish_run_artifacts(pipeline: str, results: list[StageResult], out: Path) -> None:
    """The stages table (naming the run's output folder `out`) and the evaluation report, its
    images inlined: the UI cannot reach files on the worker."""
    rows = [f"| {r.stage} | {r.status} | `{r.key[:12]}` | {r.seconds:.1f} | {r.reason or '-'} |" for r in results]
    table = ["| stage | status | key | seconds | why |", "|---|---|---|---|---|", *rows]
    create_markdown_artifact("\n".join([f"# lorapipe run of `{pipeline}`", "", f"Outputs: `{out}`", "", *table]),
                             key=artifact_key(pipeline, "stages"),
                             description=f"each stage: served from the cache (hit) or computed; outputs in {out}")
    review = next((Path(r.files) / LOG_DIR / REVIEW_MD for r in results if r.stage == "caption" and r.files), None)
    if review and review.is_file():
        create_markdown_artifact(review.read_text(), key=artifact_key(pipeline, "dataset-review"),
                                 description=f"the dataset review: captions and where they came from; review.html in {out}")
    evaluated = [r for r in results if r.stage == "evaluate"]
    report = Path(evaluated[0].files) / REPORT if evaluated else None
    if report and report.is_file():
        create_markdown_artifact(embed_images(report.read_text(), report.parent), key=artifact_key(pipeline, "report"),
                                 description=f"evaluation report; its files are in {out}")
