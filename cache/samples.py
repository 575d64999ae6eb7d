"""The sample store: immutable tar shards of keyed records, readable by (shard, offset, size).

A record is a key (no dots) and a few named blobs (`{"safetensors": b"...", "json": b"..."}`),
stored as tar members `<key>.<ext>`, so the shards also stream through webdataset. A shard is
named by the digest of its bytes and committed by its index file `<name>.json`, written after
the tar is durable: a tar without an index is garbage from an interrupted writer. The index
holds each member's offset, size and content digest; `read` checks the digest on every read,
so a shard damaged in place (same size, other bytes) is never served.
"""
from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

from .digest import digest_bytes, digest_file
from .fsutil import fsync_dir, write_json_atomic

Blobs = Mapping[str, bytes]
META_FORMAT = 2  # 2: every member's content digest (format 1 had offsets and sizes only)


class DamagedRecord(ValueError):
    """A record's bytes differ from the digest recorded when its shard was written."""

    def __init__(self, shard: str, key: str, path: str, problem: str = "does not match its recorded digest"):
        self.shard, self.key, self.path, self.problem = shard, key, str(path), problem
        super().__init__(f"{path}: record {key} {problem}: the shard is damaged; `lorapipe run` drops it and"
                         " re-encodes its records (or run `lorapipe cache verify`)")

    def __reduce__(self):  # pickled whole (Prefect keeps a task's exception), not from its message
        return DamagedRecord, (self.shard, self.key, self.path, self.problem)

    def to_json(self) -> dict[str, str]:
        return {"shard": self.shard, "key": self.key, "path": self.path, "problem": self.problem}

    @classmethod
    def from_json(cls, value: dict[str, str]) -> "DamagedRecord":
        return cls(**value)


@dataclass(frozen=True, slots=True)
class RecordLocation:
    shard: str
    members: dict[str, tuple[int, int, str]]  # ext -> (data offset, size, content digest) inside the shard tar

    def to_json(self) -> dict:
        return {"shard": self.shard, "members": {k: list(v) for k, v in self.members.items()}}

    @classmethod
    def from_json(cls, value: dict) -> "RecordLocation":
        return cls(value["shard"], {k: (v[0], v[1], v[2]) for k, v in value["members"].items()})


class SampleStore:
    def __init__(self, root: Path):
        self.dir = Path(root) / "samples"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._index: dict[str, RecordLocation] | None = None

    def shard_path(self, shard: str) -> Path:
        return self.dir / f"{shard}.tar"

    def shard_meta(self, shard: str) -> dict:
        return json.loads((self.dir / f"{shard}.json").read_text())

    def refs(self, shards: Iterable[str]) -> dict[str, dict]:
        """The shards as an artifact's refs: root-relative path -> size and digest."""
        return {f"samples/{shard}.tar": {"size": (meta := self.shard_meta(shard))["size"], "digest": meta["digest"]}
                for shard in sorted(set(shards))}

    def index(self) -> dict[str, RecordLocation]:
        """Every committed record, by key (loaded once per store object); records of a shard
        written before member digests existed have none until `add_member_digests`."""
        if self._index is None:
            self._index = {}
            for meta_path in sorted(self.dir.glob("*.json")):
                meta = _read_meta(meta_path)
                if meta is None:
                    continue  # damaged index: its records count as missing and get re-encoded
                tar = self.shard_path(meta["shard"])
                if not tar.is_file() or tar.stat().st_size != meta["size"]:
                    continue  # damaged shard: likewise
                for key, members in meta["records"].items():
                    self._index[key] = RecordLocation(meta["shard"], {k: _member(v) for k, v in members.items()})
        return self._index

    def verify(self) -> list[tuple[str, str]]:
        """Re-hash every shard; remove each one that is damaged, so its records count as missing
        and are re-encoded, and any encode artifact referencing it becomes a miss. Returns
        (shard file, problem) per removed shard."""
        damaged = []
        for meta_path in sorted(self.dir.glob("*.json")):
            meta = _read_meta(meta_path)
            tar = self.shard_path(meta["shard"]) if meta else meta_path.with_suffix(".tar")
            problem = _shard_problem(tar, meta) if meta else f"its index {meta_path.name} is unreadable"
            if problem:
                self.remove(meta_path.stem)
                damaged.append((tar.name, problem))
        return damaged

    def remove(self, shard: str) -> None:
        """Drop a shard: its index first, so it stops existing at once; its records count as missing."""
        (self.dir / f"{shard}.json").unlink(missing_ok=True)
        self.shard_path(shard).unlink(missing_ok=True)
        self._index = None

    def collect(self, live: set[str], before: float) -> tuple[int, int]:
        """Remove the shards no `live` ref (`samples/<shard>.tar`) names that were committed before
        `before` (an encode in progress has committed shards nothing references yet). Returns
        (shards removed, bytes freed)."""
        count = size = 0
        for meta_path in sorted(self.dir.glob("*.json")):
            tar = meta_path.with_suffix(".tar")
            if f"samples/{tar.name}" in live or meta_path.stat().st_mtime >= before:
                continue
            size += tar.stat().st_size if tar.exists() else 0
            self.remove(meta_path.stem)
            count += 1
        return count, size

    def add_member_digests(self, keys: Iterable[str]) -> tuple[int, list[tuple[str, str]]]:
        """Record member digests in the index of every shard that holds one of `keys` and was
        written without them, after checking the shard against its own digest (a damaged one is
        removed instead). Returns (shards completed, [(shard file, problem)] removed)."""
        index = self.index()
        old = sorted({index[k].shard for k in keys if k in index and _undigested(index[k])})
        removed = []
        for shard in old:
            meta, payload = self.shard_meta(shard), self._shard_bytes(shard)
            if digest_bytes(payload) != meta["digest"]:
                self.remove(shard)
                removed.append((f"{shard}.tar", "does not match its recorded digest"))
                continue
            meta["records"] = {key: {ext: [o, s, digest_bytes(payload[o:o + s])] for ext, (o, s, *_) in members.items()}
                               for key, members in meta["records"].items()}
            self._commit(shard, {**meta, "format": META_FORMAT})
        self._index = None
        return len(old) - len(removed), removed

    def missing(self, keys: Iterable[str]) -> list[str]:
        index = self.index()
        return sorted({k for k in keys if k not in index})

    def read(self, key: str, location: RecordLocation, ext: str) -> bytes:
        """Member `ext` of record `key`, checked against its recorded digest (DamagedRecord if not)."""
        offset, size, digest = location.members[ext]
        try:
            with open(self._readable(location.shard), "rb") as f:
                f.seek(offset)
                data = f.read(size)
        except FileNotFoundError:
            raise DamagedRecord(location.shard, key, self.shard_location(location.shard),
                                "is gone: its shard was removed") from None
        if len(data) != size:
            raise DamagedRecord(location.shard, key, self.shard_location(location.shard),
                                "is cut short: the shard is truncated")
        if digest_bytes(data) != digest:
            raise DamagedRecord(location.shard, key, self.shard_location(location.shard))
        return data

    def write_shard(self, records: Mapping[str, Blobs]) -> str:
        """Write records (in key order) as one shard; return its name. Idempotent.

        webdataset's TarWriter writes the tar in memory, one member per call so that each
        member's data offset is known as it is written; its fixed mtime, owner and mode make
        the bytes (and so the shard's name) depend on the records alone. The durable write and
        atomic rename stay ours: TarWriter and ShardWriter write in place."""
        from webdataset import TarWriter  # imports torch: only processes that encode pay for it

        buffer = io.BytesIO()
        members: dict[str, dict[str, tuple[int, int, str]]] = {}
        with TarWriter(buffer, user="", group="", mode=0o644, mtime=0, encoder=False) as tar:
            for key in sorted(records):
                if "." in key:
                    raise ValueError(f"record key {key!r} contains a dot")
                members[key] = {}
                for ext in sorted(records[key]):
                    data = records[key][ext]
                    tar.write({"__key__": key, ext: data})
                    members[key][ext] = (tar.tarstream.offset - _padded(len(data)), len(data), digest_bytes(data))
        payload = buffer.getvalue()
        shard = digest_bytes(payload)[:32]
        self._write_durable(self.shard_path(shard), payload)
        meta = {"format": META_FORMAT, "shard": shard, "size": len(payload), "digest": digest_bytes(payload),
                "records": members}
        self._commit(shard, meta)
        if self._index is not None:
            for key, m in members.items():
                self._index[key] = RecordLocation(shard, m)
        return shard

    # ---- where shards are kept (ObjectSampleStore keeps them on object storage)
    def shard_location(self, shard: str) -> str:
        """Where the shard is kept, as messages name it."""
        return str(self.shard_path(shard))

    def _readable(self, shard: str) -> Path:
        """A local file holding the shard's bytes (FileNotFoundError when it is gone)."""
        return self.shard_path(shard)

    def _shard_bytes(self, shard: str) -> bytes:
        return self.shard_path(shard).read_bytes()

    def _commit(self, shard: str, meta: dict) -> None:
        """Write a shard's index, which commits it (its tar is durable by now)."""
        write_json_atomic(self.dir / f"{shard}.json", meta)

    def _write_durable(self, path: Path, payload: bytes) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)


def _read_meta(path: Path) -> dict | None:
    try:
        meta = json.loads(path.read_text())
        return meta if {"shard", "size", "digest", "records"} <= set(meta) else None
    except (OSError, ValueError):
        return None


def _shard_problem(tar: Path, meta: dict) -> str:
    if not tar.is_file():
        return "missing"
    if tar.stat().st_size != meta["size"]:
        return f"has {tar.stat().st_size} bytes, its index says {meta['size']}"
    if digest_file(tar) != meta["digest"]:
        return "does not match its recorded digest"
    return ""


def _member(value: list) -> tuple[int, int, str]:
    """(offset, size, digest); the digest is "" in an index written before digests were recorded."""
    return (value[0], value[1], value[2] if len(value) > 2 else "")


def _undigested(location: RecordLocation) -> bool:
    return any(not digest for _, _, digest in location.members.values())


def _padded(size: int) -> int:
    return (size + 511) // 512 * 512
