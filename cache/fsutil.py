"""Durable file-system primitives: fsync'd writes and atomic publication."""
from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def user_cache_dir() -> Path:
    """lorapipe's folder in the user's cache: ~/.cache/lorapipe (XDG_CACHE_HOME is honoured)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lorapipe"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def write_json_atomic(path: Path, value: Any) -> None:
    """Write JSON to `path` via a fsync'd temporary file and one rename."""
    write_text_atomic(path, json.dumps(value, indent=1, sort_keys=True))


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` via a fsync'd temporary file and one rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_json_rows(path: Path, fields: dict[str, Any], rows_key: str, rows: Iterable[Any]) -> None:
    """Write {**fields, rows_key: [*rows]} as JSON, one row per line, streaming the rows: an
    index of many rows never exists as one string (json's indenting encoder holds a string per
    token: 80 MiB for 10,000 samples)."""
    head = json.dumps(fields, sort_keys=True)[:-1]
    with open(path, "w") as f:
        f.write(f"{head}{', ' if fields else ''}{json.dumps(rows_key)}: [")
        for i, row in enumerate(rows):
            f.write(("\n" if i == 0 else ",\n") + json.dumps(row, sort_keys=True))
        f.write("\n]}\n")


def remove_tree(path: Path) -> None:
    """Remove a directory by first renaming it aside, so a crash never leaves half of it in place."""
    if not path.exists():
        return
    doomed = path.with_name(f".trash-{path.name}-{os.getpid()}")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def publish_folder(staging: Path, target: Path) -> None:
    """Rename the complete folder `staging` to `target` (atomic); where another process published
    `target` first, its folder stays and `staging` is removed."""
    try:
        staging.rename(target)
    except OSError:
        if not target.is_dir():
            raise
        shutil.rmtree(staging)


def probe_writable(folder: Path) -> None:
    """Create `folder` if needed, then write, fsync and remove a small file in it: raises the
    OSError a full, read-only or forbidden folder (or a file in its place) gives."""
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / f".probe-{os.getpid()}-{threading.get_ident()}"  # threads of a sweep probe side by side
    with open(probe, "wb") as f:
        f.write(b"probe")
        os.fsync(f.fileno())
    probe.unlink()
