"""Garbage collection: drop artifacts no pipeline needs any more, then unreferenced shards."""
from __future__ import annotations

import json
import shutil
import time

from .store import ArtifactStore

SHARD_GRACE_SECONDS = 3600  # an encode in progress has committed shards no artifact references yet


def collect(store: ArtifactStore, keep_seconds: float) -> dict[str, int]:
    now = time.time()
    latest = set()
    for refs_path in (store.root / "refs").glob("*.json"):
        latest |= {(stage, ref["key"]) for stage, ref in json.loads(refs_path.read_text()).items()}
    freed = {"artifacts": 0, "shards": 0, "bytes": 0}
    live_refs: set[str] = set()
    for artifact in list(store.artifacts()):
        last = max([artifact.manifest["created"], *(u["time"] for u in store.uses(artifact))])
        if (artifact.stage, artifact.key) in latest or now - last < keep_seconds:
            live_refs |= set(artifact.manifest.get("refs", {}))
            continue
        freed["bytes"] += sum(e["size"] for e in artifact.manifest["files"].values())
        store.remove(artifact)
        freed["artifacts"] += 1
    samples = store.root / "samples"
    for meta_path in sorted(samples.glob("*.json")) if samples.is_dir() else []:
        tar = meta_path.with_suffix(".tar")
        if f"samples/{tar.name}" in live_refs or now - meta_path.stat().st_mtime < SHARD_GRACE_SECONDS:
            continue
        freed["bytes"] += tar.stat().st_size if tar.exists() else 0
        meta_path.unlink()  # the index first: without it the shard no longer exists
        tar.unlink(missing_ok=True)
        freed["shards"] += 1
    for trash in store.root.rglob(".trash-*"):
        shutil.rmtree(trash, ignore_errors=True)
    return freed
