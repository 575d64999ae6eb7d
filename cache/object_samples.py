"""The sample store on object storage, and this host's read-through cache of its shards.

Layout on the root is the local one: `samples/<shard>.tar`, committed by `samples/<shard>.json`
written after it with If-None-Match (a shard is named by its content digest, so a second writer
of the same name wrote the same bytes). A tar without its index is an interrupted upload: it does
not exist, and gc removes it.

Reading a record downloads its whole shard once into the shard cache, `<local>/shards/<shard>.tar`:
named by the shard's content digest and checked against it on download, so a cached copy is
always right, and deleting any of it is safe (it is fetched again). It is bounded in size: the
least recently used shards go first. Every record read is still checked against its own digest.
Shard indexes are immutable too and are kept in `<local>/shard-index/`, so listing the store costs
one request per 1,000 objects and fetching only the indexes this host has not seen.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Callable

from .digest import digest_bytes, digest_file
from .lock import key_lock
from .objects import ObjectRoot
from .samples import RecordLocation, SampleStore, _member, _read_meta

PREFIX = "samples/"
EVICT_EVERY = 0.1  # rescan the cache after adding this share of its budget


class ShardCache:
    """Local copies of shards, keyed by content digest, size-bounded, safe to delete."""

    def __init__(self, folder: Path, max_bytes: int):
        self.folder, self.max_bytes = Path(folder), max_bytes
        self.folder.mkdir(parents=True, exist_ok=True)
        self._touched: set[str] = set()
        self._added = max_bytes  # scan on the first addition
        self._lock = threading.Lock()

    def path(self, shard: str) -> Path:
        return self.folder / f"{shard}.tar"

    def fetch(self, shard: str, download: Callable[[Path], None]) -> Path:
        """The cached copy of `shard`, downloaded with `download(tmp_path)` if there is none.
        Bytes that are not the shard's are not cached: they are returned from a hidden file, fetched
        again next time, so that reading them reports the damaged record."""
        path = self.path(shard)
        if path.exists():
            self._touch(shard, path)
            return path
        with key_lock(self.folder / ".locks" / f"{shard}.lock"):  # one download per shard across processes
            if not path.exists():
                tmp = self.folder / f".{shard}.{os.getpid()}.{threading.get_ident()}.tmp"
                download(tmp)
                if digest_file(tmp)[:len(shard)] != shard:
                    unverified = self.folder / f".unverified-{shard}.tar"
                    os.replace(tmp, unverified)
                    return unverified
                os.replace(tmp, path)
        self._added_bytes(path.stat().st_size, keep=shard)
        return path

    def put(self, shard: str, payload: bytes) -> None:
        """Keep a shard this host has just written (so reading it back downloads nothing)."""
        tmp = self.folder / f".{shard}.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp.write_bytes(payload)
        os.replace(tmp, self.path(shard))
        self._added_bytes(len(payload), keep=shard)

    def discard(self, shard: str) -> None:
        self.path(shard).unlink(missing_ok=True)

    def _touch(self, shard: str, path: Path) -> None:
        if shard not in self._touched:  # once per process: enough to order shards by last use
            self._touched.add(shard)
            try:
                os.utime(path)
            except FileNotFoundError:
                pass

    def _added_bytes(self, size: int, keep: str) -> None:
        with self._lock:
            self._added += size
            if self._added < EVICT_EVERY * self.max_bytes:
                return
            self._added = 0
        self.evict(keep)

    def evict(self, keep: str = "") -> None:
        """Remove the least recently used shards until the cache fits its budget."""
        entries = []
        for entry in os.scandir(self.folder):
            if entry.name.endswith(".tar") and not entry.name.startswith("."):
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                entries.append((st.st_mtime, st.st_size, entry.name))
        total = sum(size for _, size, _ in entries)
        for _, size, name in sorted(entries):
            if total <= self.max_bytes:
                break
            if name != f"{keep}.tar":
                (self.folder / name).unlink(missing_ok=True)
                (self.folder / ".locks" / f"{name[:-4]}.lock").unlink(missing_ok=True)
                total -= size


class ObjectSampleStore(SampleStore):
    """SampleStore whose shards are kept on object storage (see the module's docstring)."""

    def __init__(self, local: Path, root: ObjectRoot, shard_cache: ShardCache):
        self.dir = Path(local) / "shard-index"  # this host's copies of shard indexes
        self.dir.mkdir(parents=True, exist_ok=True)
        self.root, self.cache = root, shard_cache
        self._index: dict[str, RecordLocation] | None = None

    def shard_path(self, shard: str) -> Path:
        return self.cache.path(shard)

    def shard_location(self, shard: str) -> str:
        return self.root.url_of(f"{PREFIX}{shard}.tar")

    def shard_meta(self, shard: str) -> dict:
        meta = _read_meta(self.dir / f"{shard}.json")
        if meta is None:
            data = self.root.get(f"{PREFIX}{shard}.json")
            if data is None:
                raise FileNotFoundError(f"{self.shard_location(shard)}: no such shard")
            meta = json.loads(data)
            self._keep_meta(shard, data)
        return meta

    def committed(self) -> dict[str, dict]:
        """shard -> index of every committed shard whose tar has the size its index gives."""
        listed = self.root.list(PREFIX)
        names = [rel[:-5] for rel in listed if rel.endswith(".json")]
        known = {name: _read_meta(self.dir / f"{name}.json") for name in names}
        fetched = self.root.get_many(f"{PREFIX}{name}.json" for name, meta in known.items() if meta is None)
        for rel, data in fetched.items():
            if data is not None:
                self._keep_meta(rel[len(PREFIX):-5], data)
                known[rel[len(PREFIX):-5]] = _parse_meta(data)
        return {name: meta for name, meta in known.items()
                if meta and listed.get(f"{name}.tar") and listed[f"{name}.tar"].size == meta["size"]}

    def index(self) -> dict[str, RecordLocation]:
        if self._index is None:
            self._index = {}
            for meta in self.committed().values():
                for key, members in meta["records"].items():
                    self._index[key] = RecordLocation(meta["shard"], {k: _member(v) for k, v in members.items()})
        return self._index

    def verify(self) -> list[tuple[str, str]]:
        """Download and re-hash every shard; remove each damaged one (see SampleStore.verify)."""
        listed = self.root.list(PREFIX)
        damaged = []
        for rel in sorted(r for r in listed if r.endswith(".json")):
            shard = rel[:-5]
            data = self.root.get(PREFIX + rel)
            meta = _parse_meta(data) if data else None
            problem = f"its index {rel} is unreadable" if meta is None else self._remote_problem(shard, meta, listed)
            if problem:
                self.remove(shard)
                damaged.append((f"{shard}.tar", problem))
        return damaged

    def collect(self, live: set[str], before: float) -> tuple[int, int]:
        listed = self.root.list(PREFIX)
        count = size = 0
        for rel, entry in sorted(listed.items()):
            shard, kind = rel.rsplit(".", 1)
            tar = listed.get(f"{shard}.tar")
            if kind == "json" and f"{PREFIX}{shard}.tar" not in live and entry.modified < before:
                self.remove(shard)
                count, size = count + 1, size + (tar.size if tar else 0)
            elif kind == "tar" and f"{shard}.json" not in listed and entry.modified < before:
                self.root.delete([rel])  # uploaded by a writer killed before it committed the shard
                size += entry.size
        return count, size

    def remove(self, shard: str) -> None:
        self.root.delete([f"{PREFIX}{shard}.json"])  # the index first: the shard stops existing at once
        self.root.delete([f"{PREFIX}{shard}.tar"])
        (self.dir / f"{shard}.json").unlink(missing_ok=True)
        self.cache.discard(shard)
        self._index = None

    def _readable(self, shard: str) -> Path:
        def download(tmp: Path) -> None:
            try:
                self.root.download(f"{PREFIX}{shard}.tar", tmp)
            except FileNotFoundError:
                raise FileNotFoundError(self.shard_location(shard)) from None

        return self.cache.fetch(shard, download)

    def _shard_bytes(self, shard: str) -> bytes:
        data = self.root.get(f"{PREFIX}{shard}.tar")
        if data is None:
            raise FileNotFoundError(self.shard_location(shard))
        return data

    def _commit(self, shard: str, meta: dict) -> None:
        data = json.dumps(meta, indent=1, sort_keys=True).encode()
        if not self.root.put_new(f"{PREFIX}{shard}.json", data) and meta.get("format") != _parse_meta(
                self.root.get(f"{PREFIX}{shard}.json") or b"{}").get("format"):
            self.root.put(f"{PREFIX}{shard}.json", data)  # add_member_digests upgrading an old index
        self._keep_meta(shard, data)

    def _write_durable(self, path: Path, payload: bytes) -> None:
        shard = path.name.removesuffix(".tar")
        self.root.put(f"{PREFIX}{shard}.tar", payload)
        self.cache.put(shard, payload)

    def _keep_meta(self, shard: str, data: bytes) -> None:
        tmp = self.dir / f".{shard}.json.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, self.dir / f"{shard}.json")

    def _remote_problem(self, shard: str, meta: dict, listed: dict) -> str:
        entry = listed.get(f"{shard}.tar")
        if entry is None:
            return "missing"
        if entry.size != meta["size"]:
            return f"has {entry.size} bytes, its index says {meta['size']}"
        data = self.root.get(f"{PREFIX}{shard}.tar")
        if data is None:
            return "missing"
        return "" if digest_bytes(data) == meta["digest"] else "does not match its recorded digest"


def _parse_meta(data: bytes) -> dict | None:
    try:
        meta = json.loads(data)
        return meta if isinstance(meta, dict) and {"shard", "size", "digest", "records"} <= set(meta) else None
    except ValueError:
        return None
