"""Digests: canonical JSON, file contents (blake3), and a persistent stat cache.

A file's digest is looked up by (path, size, mtime_ns, inode) in a sqlite table so that an
unchanged file is never read twice; touching a file without changing its bytes re-hashes it
but yields the same digest, so nothing downstream changes.
"""
from __future__ import annotations

import json
import os
import sqlite3
import threading
from pathlib import Path
from typing import Any, Callable

from blake3 import blake3

from .objects import ObjectFile

CHUNK = 1 << 20


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def digest_json(value: Any) -> str:
    return blake3(canonical_json(value).encode()).hexdigest()


def digest_bytes(data: bytes) -> str:
    return blake3(data).hexdigest()


def digest_file(path: Path) -> str:
    hasher = blake3()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            hasher.update(chunk)
    return hasher.hexdigest()


class StatCache:
    """Maps (path, size, mtime_ns, inode) to a content digest, persisted in sqlite; and, per file
    version too, values derived from a file's content by a named computation (`derived`)."""

    def __init__(self, db_path: Path, read_only: bool = False):
        """read_only: for a folder this process may not write: the digests the database holds are
        used (none where there is no database yet), and new ones are kept in memory only."""
        self.read_only = read_only
        if read_only:  # immutable: no lock, journal or -shm file to create beside it
            where = f"{db_path.resolve().as_uri()}?immutable=1" if db_path.exists() else ":memory:"
            self._db = sqlite3.connect(where, uri=True, check_same_thread=False)
        else:
            db_path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(db_path, timeout=60, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS digests (path TEXT PRIMARY KEY, size INTEGER,"
            " mtime_ns INTEGER, inode INTEGER, digest TEXT)"
        )
        try:
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS derived (path TEXT, what TEXT, size INTEGER, mtime_ns INTEGER,"
                " inode INTEGER, value TEXT, PRIMARY KEY (path, what))"
            )
            self._has_derived = True
        except sqlite3.OperationalError:  # a read-only database made before derived values existed
            self._has_derived = False
        self._lock = threading.Lock()
        self._known: dict[str, tuple] | None = None  # every row, loaded on first use: one query, not one a file
        self._pending: dict[str, tuple] = {}  # rows not yet committed
        self.hashed = 0  # files actually read since this cache was opened

    def digest(self, path: str | Path | ObjectFile) -> str:
        """A file's content digest; an object on object storage is known by (URL, size, ETag)."""
        if isinstance(path, ObjectFile):
            return self._cached(path.url, (path.size, 0, path.etag), lambda: digest_bytes(path.read_bytes()))
        path = os.path.abspath(path)
        st = os.stat(path)
        return self._cached(path, (st.st_size, st.st_mtime_ns, st.st_ino), lambda: digest_file(Path(path)))

    def derived(self, path: str | Path, what: str, compute: Callable[[Path], str]) -> str:
        """compute(path), a string derived from the file's content (`what` names the computation and
        its version), computed once per file version: the same file unchanged is never read again."""
        path = os.path.abspath(path)
        st = os.stat(path)
        version = (st.st_size, st.st_mtime_ns, st.st_ino)
        with self._lock:
            row = self._has_derived and self._db.execute(
                "SELECT size, mtime_ns, inode, value FROM derived WHERE path = ? AND what = ?", (path, what)).fetchone()
        if row and tuple(row[:3]) == version:
            return row[3]
        value = compute(Path(path))
        with self._lock:
            self.hashed += 1
            if self._has_derived and not self.read_only:
                self._db.execute("INSERT OR REPLACE INTO derived VALUES (?,?,?,?,?,?)", (path, what, *version, value))
                self._db.commit()
        return value

    def _cached(self, name: str, version: tuple, compute) -> str:
        with self._lock:
            if self._known is None:
                self._known = {row[0]: row for row in self._db.execute("SELECT * FROM digests")}
            row = self._known.get(name)
        if row and row[1:4] == version:
            return row[4]
        digest = compute()
        with self._lock:
            self.hashed += 1
            self._known[name] = row = (name, *version, digest)
            if not self.read_only:
                self._pending[name] = row
            if len(self._pending) >= 512:
                self._flush()
        return digest

    def _flush(self) -> None:
        if self._pending:
            self._db.executemany("INSERT OR REPLACE INTO digests VALUES (?,?,?,?,?)", self._pending.values())
            self._db.commit()
            self._pending.clear()

    def close(self) -> None:
        with self._lock:
            self._flush()
        self._db.close()

    def __enter__(self) -> "StatCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def digest_tree(root: Path, stat_cache: StatCache, suffixes: tuple[str, ...] | None = None) -> str:
    """Digest of every file under `root` (relative paths + contents), order-independent."""
    entries = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        if suffixes and path.suffix.lower() not in suffixes:
            continue
        entries.append([path.relative_to(root).as_posix(), stat_cache.digest(path)])
    return digest_json(entries)


def path_identity(path: str | Path | None, stat_cache: StatCache) -> str:
    """What an optional local file or folder contributes to a key: its content digest, or
    "none" / "missing" — so a file that appears later at the same path invalidates what used it."""
    if path is None:
        return "none"
    path = Path(path)
    if path.is_file():
        return stat_cache.digest(path)
    return digest_tree(path, stat_cache) if path.is_dir() else "missing"
