"""Garbage collection: drop artifacts no pipeline needs any more, then unreferenced shards.

What is kept: every pipeline's latest artifact per stage (its refs), what each pipeline's last N
completed runs used (`store.record_run`), and what was created or used at or after a cutoff time.
Works on any store (a local folder or object storage) through its methods.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from .store import Artifact, ArtifactStore

SHARD_GRACE_SECONDS = 3600  # an encode in progress has committed shards no artifact references yet


@dataclass
class Freed:
    removed: list[str] = field(default_factory=list)  # "stage/key" of each removed artifact
    shards: int = 0
    work_dirs: int = 0  # resumable work (training checkpoints) no kept artifact came from
    bytes: int = 0


def kept_keys(store: ArtifactStore, keep_last: int) -> set[tuple[str, str]]:
    """(stage, key) of every pipeline's latest artifacts and of what its last `keep_last` runs used."""
    kept = set()
    for refs in store.pipeline_refs().values():
        kept |= {(stage, ref["key"]) for stage, ref in refs.items()}
    for runs in store.runs().values():
        for run in runs[-keep_last:] if keep_last > 0 else []:
            kept |= set(run["keys"].items())
    return kept


def last_used(store: ArtifactStore, artifact: Artifact) -> float:
    return max([artifact.manifest["created"], *(u["time"] for u in store.uses(artifact))])


def collect(store: ArtifactStore, keep_last: int = 0, keep_since: float | None = None,
            grace: float = SHARD_GRACE_SECONDS) -> Freed:
    """Remove artifacts outside `kept_keys` not used since `keep_since`, then dead shards and work
    directories untouched for `grace` seconds."""
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
    shards, size = store.sample_store().collect(live_refs, time.time() - grace)
    freed.shards, freed.bytes = shards, freed.bytes + size
    _collect_work_dirs(store, live_work, freed, grace)
    store.sweep(time.time() - grace)
    return freed


def _collect_work_dirs(store: ArtifactStore, live: set[tuple[str, str]], freed: Freed, grace: float) -> None:
    """Remove work directories that no kept artifact was built from, no run is using (its lock is
    free) and no run touched lately (a killed run's checkpoints stay resumable for a while)."""
    now = time.time()
    for work in store.work_dirs():
        if (work.stage, work.work_key) in live or now - work.modified < grace:
            continue
        if store.remove_work_dir(work.stage, work.work_key):
            freed.bytes += work.bytes
            freed.work_dirs += 1
