"""What a run shows in the Prefect UI besides its logs: progress bars for encode and train, a
table of the stages (hit or computed, key, duration) and the evaluation report.

The stages stay Prefect-free: progress is read from the log lines they already print.
"""
from __future__ import annotations

import re
from pathlib import Path
from uuid import UUID

from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact

from .runner import StageResult

PROGRESS_LINES = {  # stage -> the log line that says how far it is: (done, total)
    "encode": re.compile(r"^encode: latents (\d+)/(\d+)\b"),
    "train": re.compile(r"^step (\d+)/(\d+) "),
}


class StageProgress:
    """A progress artifact for one stage run, moved by the stage's own log lines."""

    def __init__(self, stage: str):
        self.stage, self.pattern = stage, PROGRESS_LINES.get(stage)
        self.artifact_id: UUID | None = None
        self.shown = -1

    def __call__(self, line: str) -> None:
        match = self.pattern.match(line) if self.pattern else None
        if not match:
            return
        percent = min(100, round(100 * int(match[1]) / max(1, int(match[2]))))
        if percent == self.shown:
            return
        if self.artifact_id is None:
            self.artifact_id = create_progress_artifact(percent, description=f"{self.stage} progress")
        else:
            update_progress_artifact(self.artifact_id, percent)
        self.shown = percent


def artifact_key(pipeline: str, what: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{pipeline}-{what}".lower())


def publish_run_artifacts(pipeline: str, results: list[StageResult]) -> None:
    rows = [f"| {r.stage} | {r.status} | `{r.key[:12]}` | {r.seconds:.1f} | {r.reason or '-'} |" for r in results]
    table = ["| stage | status | key | seconds | why |", "|---|---|---|---|---|", *rows]
    create_markdown_artifact("\n".join([f"# lorapipe run of `{pipeline}`", "", *table]),
                             key=artifact_key(pipeline, "stages"),
                             description="each stage: served from the cache (hit) or computed")
    evaluated = [r for r in results if r.stage == "evaluate"]
    report = Path(evaluated[0].path) / "report.md" if evaluated else None
    if report and report.is_file():
        create_markdown_artifact(report.read_text(), key=artifact_key(pipeline, "report"),
                                 description=f"evaluation report ({report})")
