"""What one variant of a sweep left: the run that trained and evaluated it (the sweep's flow) hands
these to the report and to publishing the best."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class VariantOutcome:
    """One variant: its `name` (a folder-safe label made from its overrides), the `overrides` that
    made it (dotted config key -> value, as given), `output_dir` (its published files, laid out as
    a `lorapipe run` output folder: run-summary.json, the LoRA, metrics.json, the grids) and
    `error`, one line when it failed (its output folder may then hold fewer files, or none)."""

    name: str
    overrides: dict[str, Any] = field(default_factory=dict)
    output_dir: Path | None = None
    error: str | None = None

    @property
    def succeeded(self) -> bool:
        return self.error is None
