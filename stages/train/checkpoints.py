"""Training checkpoints in the work directory: `checkpoints/step-XXXXXX/`, committed atomically.

A checkpoint is staged in `checkpoints/.staging-step-XXXXXX/`, sealed by `checkpoint.json`
(step, max_steps of the run that wrote it, every file's size and digest) and renamed into place.
A directory whose files do not match its `checkpoint.json` is damaged.

Only the training processes write here, and only while their stage process holds the work
directory's lock (cache/store.py), so rotation never races a forced rebuild, `gc` or another run
that extends the same training.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

from lorapipe.cache.digest import digest_file
from lorapipe.cache.errors import UserError
from lorapipe.cache.fsutil import fsync_dir, fsync_tree, remove_tree, write_json_atomic
from lorapipe.stages.lora_formats.lora_folder import step_name

SEAL = "checkpoint.json"


class CheckpointDir:
    def __init__(self, root: Path):
        self.root = Path(root)

    def path(self, step: int) -> Path:
        return self.root / step_name(step)

    def staging(self, step: int) -> Path:
        return self.root / f".staging-{step_name(step)}"

    def steps(self) -> list[int]:
        """Steps of the committed checkpoints, oldest first (damaged ones included)."""
        if not self.root.is_dir():
            return []
        return sorted(int(p.name.removeprefix("step-")) for p in self.root.glob("step-[0-9]*") if p.is_dir())

    def remove_staging(self) -> None:
        """Drop half-written checkpoints left by a run that was killed while saving."""
        for stale in self.root.glob(".staging-*"):
            shutil.rmtree(stale, ignore_errors=True)

    def damage(self, step: int) -> str:
        """Why this checkpoint cannot be trusted; empty when it is intact."""
        path = self.path(step)
        try:
            seal = json.loads((path / SEAL).read_text())
        except (OSError, ValueError):
            return f"{path / SEAL} is missing or unreadable"
        for rel, entry in seal["files"].items():
            file = path / rel
            if not file.is_file() or file.stat().st_size != entry["size"] or digest_file(file) != entry["digest"]:
                return f"{file} is missing or does not match {SEAL}"
        return ""

    def latest_intact(self, warn: Callable[[str], None]) -> int | None:
        """The newest intact checkpoint's step; None only when there are no checkpoints at all."""
        steps = self.steps()
        for step in reversed(steps):
            problem = self.damage(step)
            if not problem:
                return step
            warn(f"checkpoint {step_name(step)} is damaged ({problem}); trying the one before it")
        if steps:
            raise UserError(f"every checkpoint in {self.root} is damaged; refusing to start over silently:"
                            " run with --force train to train from scratch")
        return None

    def max_steps_of(self, step: int) -> int:
        return json.loads((self.path(step) / SEAL).read_text())["max_steps"]

    def commit(self, step: int, max_steps: int) -> None:
        """Seal the staged checkpoint and move it into place."""
        staging = self.staging(step)
        files = {
            p.relative_to(staging).as_posix(): {"size": p.stat().st_size, "digest": digest_file(p)}
            for p in sorted(staging.rglob("*")) if p.is_file()
        }
        write_json_atomic(staging / SEAL, {"step": step, "max_steps": max_steps, "files": files})
        self._move_in(step)

    def copy_into(self, other: CheckpointDir, step: int) -> None:
        """Give `other` a copy of this committed checkpoint, committed there as atomically."""
        other.root.mkdir(parents=True, exist_ok=True)
        remove_tree(other.staging(step))
        shutil.copytree(self.path(step), other.staging(step))
        other._move_in(step)

    def _move_in(self, step: int) -> None:
        """The staged checkpoint of `step`, on disk, renamed into place."""
        staging = self.staging(step)
        fsync_tree(staging)
        remove_tree(self.path(step))  # a damaged checkpoint of the same step, already skipped
        staging.rename(self.path(step))
        fsync_dir(self.root)

    def rotate(self, newest: int, every: int, keep: int) -> None:
        """Keep the newest `keep` checkpoints. A checkpoint off the `every` grid exists only
        because an earlier run ended there: drop it once a newer one exists, so a resumed run
        retains the same checkpoints as one that ran straight through. Checkpoints after
        `newest` are damaged ones this run resumed before: drop them too."""
        kept = [s for s in self.steps() if s <= newest and (s % every == 0 or s == newest)][-keep:]
        for step in [s for s in self.steps() if s not in kept]:
            remove_tree(self.path(step))
