"""report.md as a run publishes it (flows/outputs.py), for tests of what the dataset's stages found."""
from __future__ import annotations

from pathlib import Path

from lorapipe.flows.config import validate_config
from lorapipe.flows.outputs import finish_run
from lorapipe.flows.runner import StageResult

EVALUATION = "# Evaluation\n"  # an evaluation's own report.md, before publishing adds to it


def published_report(tmp_path: Path, results: list[StageResult]) -> str:
    """The report.md a run of `results` (stages with their artifacts' files) and an evaluation publishes."""
    evaluated = tmp_path / "evaluated"
    evaluated.mkdir()
    (evaluated / "report.md").write_text(EVALUATION)
    evaluation = StageResult("evaluate", "computed", "key", "digest", str(evaluated), 1.0, "miss", files=str(evaluated))
    cfg = validate_config({"name": "t", "cache_dir": tmp_path / "cache", "output_dir": tmp_path / "published",
                           "model": {"path": tmp_path}, "data": {"path": tmp_path}, "train": {},
                           "evaluate": {"prompts": ["a photo"]}}, "test")
    finish_run(cfg.output_dir, cfg, [*results, evaluation], "run", lambda line: None, record=False)
    return (cfg.output_dir / "report.md").read_text()
