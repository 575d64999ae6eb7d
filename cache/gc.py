"""Garbage collection: drop artifacts no pipeline needs any more, then unreferenced shards.

What is kept: every pipeline's latest artifact per stage (its refs), what each pipeline's last N
completed runs used (`runs/<pipeline>.jsonl`, appended by `record_run`), and what was created or
used at or after a cutoff time.
"""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .store import Artifact, ArtifactStore

SHARD_GRACE_SECONDS = 3600  # an encode in progress has committed shards no artifact references yet
RUNS_DIR = "runs"


def record_run(root: Path, pipeline: str, run: str, keys: dict[str, str]) -> None:
    """Append one completed run (its name and the artifact key of each stage it used)."""
    path = Path(root) / RUNS_DIR / f"{pipeline}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:  # one short O_APPEND write: concurrent runs do not interleave
        f.write(json.dumps({"run": run, "time": time.time(), "keys": keys}) + "\n")


def read_runs(root: Path) -> dict[str, list[dict[str, Any]]]:
    """pipeline -> its completed runs, oldest first."""
    runs = {}
    for path in sorted((Path(root) / RUNS_DIR).glob("*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line]
        runs[path.stem] = sorted(rows, key=lambda r: r["time"])
    return runs


@dataclass
class Freed:
    removed: list[str] = field(default_factory=list)  # "stage/key" of each removed artifact
    shards: int = 0
    work_dirs: int = 0  # resumable work (training checkpoints) no kept artifact came from
    bytes: int = 0


def kept_keys(store: ArtifactStore, keep_last: int) -> set[tuple[str, str]]:
    """(stage, key) of every pipeline's latest artifacts and of what its last `keep_last` runs used."""
    kept = set()
    for refs_path in (store.root / "refs").glob("*.json"):
        kept |= {(stage, ref["key"]) for stage, ref in json.loads(refs_path.read_text()).items()}
    for runs in read_runs(store.root).values():
        for run in runs[-keep_last:] if keep_last > 0 else []:
            kept |= set(run["keys"].items())
    return kept


def last_used(store: ArtifactStore, artifact: Artifact) -> float:
    return max([artifact.manifest["created"], *(u["time"] for u in store.uses(artifact))])


def collect(store: ArtifactStore, keep_last: int = 0, keep_since: float | None = None) -> Freed:
    """Remove artifacts outside `kept_keys` not used since `keep_since`, then dead shards."""
    kept = kept_keys(store, keep_last)
    freed = Freed()
    live_refs: set[str] = set()
    live_work: set[tuple[str, str]] = set()
    for artifact in list(store.artifacts()):
        recent = keep_since is not None and last_used(store, artifact) >= keep_since
        if (artifact.stage, artifact.key) in kept or recent or not store.remove(artifact, wait=False):
            live_refs |= set(artifact.manifest.get("refs", {}))  # kept, or in use by a running build
            live_work.add((artifact.stage, artifact.work_key))
            continue
        freed.bytes += sum(e["size"] for e in artifact.manifest["files"].values())
        freed.removed.append(f"{artifact.stage}/{artifact.key}")
    now = time.time()
    samples = store.root / "samples"
    for meta_path in sorted(samples.glob("*.json")) if samples.is_dir() else []:
        tar = meta_path.with_suffix(".tar")
        if f"samples/{tar.name}" in live_refs or now - meta_path.stat().st_mtime < SHARD_GRACE_SECONDS:
            continue
        freed.bytes += tar.stat().st_size if tar.exists() else 0
        meta_path.unlink()  # the index first: without it the shard no longer exists
        tar.unlink(missing_ok=True)
        freed.shards += 1
    _collect_work_dirs(store, live_work, freed)
    for trash in store.root.rglob(".trash-*"):
        shutil.rmtree(trash, ignore_errors=True)
    return freed


def _collect_work_dirs(store: ArtifactStore, live: set[tuple[str, str]], freed: Freed) -> None:
    """Remove work directories that no kept artifact was built from, no run is using (its lock is
    free) and no run touched lately (a killed run's checkpoints stay resumable for a while)."""
    now = time.time()
    for work in sorted((store.root / "work").glob("*/*")):
        entries = [work, *work.rglob("*")]
        if (work.parent.name, work.name) in live or now - max(e.stat().st_mtime for e in entries) < SHARD_GRACE_SECONDS:
            continue
        size = sum(e.stat().st_size for e in entries if e.is_file())
        if store.remove_work_dir(work.parent.name, work.name):
            freed.bytes += size
            freed.work_dirs += 1
