"""A configured base model resolved to local files, and a record of where they came from."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lorapipe.stages.families.folders import is_single_file

from . import hub


@dataclass(frozen=True)
class Source:
    """Where a model's (or one component's) files came from: a local folder, a single-file
    checkpoint, or a Hugging Face repo at a resolved commit."""

    kind: str  # "folder", "single file" or "hub"
    location: str  # the local path, or the repo id
    revision: str | None = None  # hub: as configured
    commit: str | None = None  # hub: what the revision resolved to

    def __str__(self) -> str:
        return f"{self.kind} {self.location}" + (f"@{self.commit}" if self.commit else "")

    def to_json(self) -> dict:
        return {k: v for k, v in vars(self).items() if v is not None}


@dataclass(frozen=True)
class BaseModel:
    path: Path  # a local diffusers folder, or a single-file checkpoint (converted by the caller)
    source: Source


def resolve_base(path: Path | str, revision: str | None = None, cached_only: bool = False) -> BaseModel:
    """model.path (a local path, or a repo id: flows/config.py decides which) as local files;
    `cached_only`: a repo only from the Hugging Face cache, never the network."""
    if isinstance(path, Path):
        return BaseModel(path, Source("single file" if is_single_file(path) else "folder", str(path)))
    snap = hub.snapshot(path, revision, cached_only)
    return BaseModel(snap.folder, Source("hub", snap.repo, snap.revision, snap.commit))
