"""A local Hugging Face cache laid out as huggingface_hub writes one (HF_HUB_CACHE), so that tests
resolve repo ids offline: models--owner--name/blobs/<sha256 of a weights file, git's blob sha of
any other>, snapshots/<commit>/<path> relative links into ../../blobs, refs/<branch or tag> holding
a commit (no newline)."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

LFS_SUFFIXES = (".safetensors",)  # stored in git LFS on the Hub: their blob is named by the sha256


def write_hub_cache(cache: Path, repo: str, model: Path, refs: tuple[str, ...] = ("main",),
                    commit: str | None = None) -> str:
    """`model`'s files as a snapshot of `repo` at `commit` (default: a digest of the files) in the
    Hugging Face cache `cache`, each of `refs` pointing at it; returns the commit."""
    files = sorted(p for p in model.rglob("*") if p.is_file())
    commit = commit or hashlib.sha1(b"".join(blob_name(p, hub_bytes(p, model, repo)).encode()
                                             for p in files)).hexdigest()
    root = cache / f"models--{repo.replace('/', '--')}"
    for file in files:
        data = hub_bytes(file, model, repo)
        blob = root / "blobs" / blob_name(file, data)
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            blob.write_bytes(data)
        link = root / "snapshots" / commit / file.relative_to(model)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (root / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (root / "refs" / ref).write_text(commit)
    return commit


def hub_bytes(file: Path, model: Path, repo: str) -> bytes:
    """The file as the Hub serves it: a modular pipeline's index loads its components from the repo
    (ModularPipeline.save_pretrained, pushed), not from the folder it was saved into."""
    data = file.read_bytes()
    if file.name != "modular_model_index.json":
        return data
    return data.decode().replace(json.dumps(str(model)), json.dumps(repo)).encode()


def blob_name(file: Path, data: bytes | None = None) -> str:
    data = file.read_bytes() if data is None else data
    if file.suffix in LFS_SUFFIXES:
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
