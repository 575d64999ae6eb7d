"""How far a command got: its pipeline, its log and the stages that ran, for the one JSON document
a command given --json prints when it fails (flows/cli.py)."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class RunRecord:
    pipeline: str | None = None
    log: Path | None = None
    stages: list[dict[str, Any]] = field(default_factory=list)  # each a summary row, or {stage, status: failed}

    def failure(self, error: str, exit_code: int) -> dict[str, Any]:
        """The document --json prints for a command that ended with `error`."""
        return {"error": error, "exit_code": exit_code, "pipeline": self.pipeline,
                "log": str(self.log) if self.log else None, "stages": self.stages}


_current: ContextVar[RunRecord | None] = ContextVar("lorapipe_run_record", default=None)


@contextmanager
def recording() -> Iterator[RunRecord]:
    """A record that this context's (and its Prefect tasks') stages are added to."""
    record = RunRecord()
    token = _current.set(record)
    try:
        yield record
    finally:
        _current.reset(token)


def current() -> RunRecord:
    """The record being kept, or a throwaway one where no command keeps one (a deployment's run)."""
    return _current.get() or RunRecord()
