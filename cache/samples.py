"""The sample store: immutable tar shards of keyed records, readable by (shard, offset, size).

A record is a key (no dots) and a few named blobs (`{"safetensors": b"...", "json": b"..."}`),
stored as tar members `<key>.<ext>`, so the shards also stream through webdataset. A shard is
named by the digest of its bytes and committed by its index file `<name>.json`, written after
the tar is durable: a tar without an index is garbage from an interrupted writer.
"""
from __future__ import annotations

import io
import json
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

from .digest import digest_bytes, digest_file
from .fsutil import fsync_dir, write_json_atomic

Blobs = Mapping[str, bytes]


@dataclass(frozen=True, slots=True)
class RecordLocation:
    shard: str
    members: dict[str, tuple[int, int]]  # ext -> (data offset, size) inside the shard tar

    def to_json(self) -> dict:
        return {"shard": self.shard, "members": {k: list(v) for k, v in self.members.items()}}

    @classmethod
    def from_json(cls, value: dict) -> "RecordLocation":
        return cls(value["shard"], {k: (v[0], v[1]) for k, v in value["members"].items()})


class SampleStore:
    def __init__(self, root: Path):
        self.dir = Path(root) / "samples"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._index: dict[str, RecordLocation] | None = None

    def shard_path(self, shard: str) -> Path:
        return self.dir / f"{shard}.tar"

    def shard_meta(self, shard: str) -> dict:
        return json.loads((self.dir / f"{shard}.json").read_text())

    def index(self) -> dict[str, RecordLocation]:
        """Every committed record, by key (loaded once per store object)."""
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
                    self._index[key] = RecordLocation(
                        meta["shard"], {k: (v[0], v[1]) for k, v in members.items()}
                    )
        return self._index

    def verify(self) -> list[tuple[str, str]]:
        """Re-hash every shard; remove each one that is damaged (its index first, so it stops
        existing at once), so its records count as missing and are re-encoded, and any encode
        artifact referencing it becomes a miss. Returns (shard file, problem) per removed shard."""
        damaged = []
        for meta_path in sorted(self.dir.glob("*.json")):
            meta = _read_meta(meta_path)
            tar = self.shard_path(meta["shard"]) if meta else meta_path.with_suffix(".tar")
            if meta is None:
                problem = f"its index {meta_path.name} is unreadable"
            elif not tar.is_file():
                problem = "missing"
            elif tar.stat().st_size != meta["size"]:
                problem = f"has {tar.stat().st_size} bytes, its index says {meta['size']}"
            elif digest_file(tar) != meta["digest"]:
                problem = "does not match its recorded digest"
            else:
                continue
            meta_path.unlink()
            tar.unlink(missing_ok=True)
            damaged.append((tar.name, problem))
        self._index = None
        return damaged

    def missing(self, keys: Iterable[str]) -> list[str]:
        index = self.index()
        return sorted({k for k in keys if k not in index})

    def read(self, location: RecordLocation, ext: str) -> bytes:
        offset, size = location.members[ext]
        with open(self.shard_path(location.shard), "rb") as f:
            f.seek(offset)
            data = f.read(size)
        if len(data) != size:
            raise OSError(f"shard {self.shard_path(location.shard)} is truncated")
        return data

    def write_shard(self, records: Mapping[str, Blobs]) -> str:
        """Write records (in key order) as one shard; return its name. Idempotent."""
        buffer = io.BytesIO()
        members: dict[str, dict[str, tuple[int, int]]] = {}
        with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for key in sorted(records):
                if "." in key:
                    raise ValueError(f"record key {key!r} contains a dot")
                members[key] = {}
                for ext in sorted(records[key]):
                    data = records[key][ext]
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size, info.mtime, info.mode = len(data), 0, 0o644
                    tar.addfile(info, io.BytesIO(data))
                    members[key][ext] = (tar.offset - _padded(len(data)), len(data))
        payload = buffer.getvalue()
        shard = digest_bytes(payload)[:32]
        self._write_durable(self.shard_path(shard), payload)
        meta = {"shard": shard, "size": len(payload), "digest": digest_bytes(payload), "records": members}
        write_json_atomic(self.dir / f"{shard}.json", meta)
        if self._index is not None:
            for key, m in members.items():
                self._index[key] = RecordLocation(shard, m)
        return shard

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


def _padded(size: int) -> int:
    return (size + 511) // 512 * 512
