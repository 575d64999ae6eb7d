"""What every stage shares: frozen params models and the run signature's types.

A stage module exposes VERSION, a `Params` model (exactly the settings that change its output),
optionally an `Options` model (settings that do not: batch sizes, worker counts), an inputs
dataclass, and `run(params, inputs, out_dir, work_dir, options, log) -> Built | None`.
"""
from __future__ import annotations

from functools import cache
from importlib.metadata import version
from typing import Callable

from pydantic import BaseModel, ConfigDict

Log = Callable[[str], None]


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def library_majors(*names: str) -> dict[str, str]:
    """Major versions of the libraries that compute an output (keyed: a minor upgrade keeps caches)."""
    return {name: _version(name).split(".")[0] for name in names}


def library_versions(*names: str) -> dict[str, str]:
    """Exact versions, recorded in manifests for provenance but never keyed."""
    return {name: _version(name) for name in names}


@cache
def _version(name: str) -> str:  # reading package metadata costs ~2 ms; record keys ask per sample
    return version(name)
