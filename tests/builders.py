"""Helpers for tests that run builders as processes of their own and follow them through a marker file."""
from __future__ import annotations

import subprocess
from pathlib import Path


def marker_lines(tmp_path: Path) -> list[str]:
    """The lines the builders appended to tmp_path/marker so far."""
    path = tmp_path / "marker"
    return path.read_text().splitlines() if path.exists() else []


def finished(process: subprocess.Popen, timeout: float = 60) -> str:
    """The builder's output, once it exited successfully."""
    out = process.communicate(timeout=timeout)[0]
    assert process.returncode == 0, out
    return out
