"""The dataset review written into the caption artifact: a minimal review.md listing each sample's
final caption and where it came from (the review helper's page replaces it)."""
from __future__ import annotations

from pathlib import Path

from ..preprocess.sources import DatasetSource

REVIEW_FILE = "review.md"


def write_review(out_dir: Path, samples: list[dict], captions: dict, report: dict,
                 datasets: tuple[DatasetSource, ...]) -> None:
    """`samples`: the caption artifact's dataset.json samples; `captions`: captions.json; `report`:
    preprocess's report.json."""
    rows = ["| sample | source | caption |", "|---|---|---|"]
    for s in samples:
        entry = captions["samples"][s["id"]]
        rows.append(f"| {_cell(s['id'])} | {entry['source']} | {_cell(entry['caption'])} |")
    rejected = f"\n\n{len(report.get('rejected', []))} files rejected by preprocess (report.json)."
    (Path(out_dir) / REVIEW_FILE).write_text("# Captions\n\n" + "\n".join(rows) + rejected + "\n")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
