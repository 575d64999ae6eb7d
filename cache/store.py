"""The artifact store: `<root>/<stage>/<key>/` directories committed by their manifest.

A directory without a valid `manifest.json` does not exist. Artifacts are built in a private
temporary directory, fsynced, and published with one rename; readers take no lock because
published artifacts are never modified.

Locks: every step that writes or removes something of a key (a build, a forced rebuild, `cache rm`,
`gc`) holds the lock of the key's *work key*. Keys that differ only in what a run may extend (train's
max_steps) share one work directory, so they share one lock: two of them never write the same
checkpoints at once, and a removal never pulls a work directory from under a running build.

An artifact's digest (what the keys of later stages hold) covers its data only, so that a
rebuild holding the same data is an early cutoff:
- every file is listed in the manifest with its size and content digest (a hit checks the sizes,
  `verify` the digests), but files under `logs/` (logs, timings, reports) and `locations/`
  (where the data is kept: offsets into shared files, the source files' names) are left out of
  the digest;
- `refs` are shared files outside the artifact that it reads from (sample store shards): a hit
  needs each with its listed size and `verify` re-hashes them, but they are left out of the
  digest too. So an artifact with refs must identify, in its digested files, every piece of
  shared data it uses (the encode artifact lists record keys); the same data kept in other
  shards (repaired, compacted) is then the same artifact.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Iterator

from .digest import canonical_json, digest_file, digest_json
from .errors import CacheRootError, naming_a_full_disk, unusable_folder
from .fsutil import fsync_tree, probe_writable, remove_tree, write_json_atomic
from .lock import key_lock
from .samples import SampleStore

MANIFEST = "manifest.json"
LOG_DIR = "logs"  # files under logs/ and locations/ are listed but left out of the data digest
LOCATIONS_DIR = "locations"
UNDIGESTED = (f"{LOG_DIR}/", f"{LOCATIONS_DIR}/")
FORMAT = 1
RUNS_DIR = "runs"
RESERVED = ("work", "locks", "refs", "uses", "samples", "tmp", "runs", "models")  # folders that hold no stage


@dataclass(frozen=True)
class StageKey:
    """What a stage's output depends on. `key` names the artifact; `work_key` names its
    resumable work directory and leaves out settings a run may extend (e.g. max_steps)."""

    stage: str
    ingredients: dict[str, Any]
    resumable: tuple[str, ...] = ()  # dotted ingredient paths left out of the work key

    @property
    def key(self) -> str:
        return hashlib.sha256(canonical_json(self.ingredients).encode()).hexdigest()

    @property
    def work_key(self) -> str:
        reduced = json.loads(canonical_json(self.ingredients))
        for dotted in self.resumable:
            *parents, leaf = dotted.split(".")
            node = reduced
            for part in parents:
                node = node[part]
            node.pop(leaf, None)
        return hashlib.sha256(canonical_json(reduced).encode()).hexdigest()


@dataclass(frozen=True)
class Artifact:
    stage: str
    key: str
    location: Path | str  # its folder, or its URL on object storage
    manifest: dict[str, Any]
    fetch: Callable[[], Path] | None = field(default=None, compare=False, repr=False)

    @cached_property
    def path(self) -> Path:
        """A local folder holding its files: the artifact's own, or on object storage this host's
        verified copy, downloaded on first use."""
        return self.fetch() if self.fetch else Path(self.location)

    @property
    def digest(self) -> str:
        return self.manifest["digest"]

    @property
    def work_key(self) -> str:
        return self.manifest.get("work_key", self.key)

    @property
    def created(self) -> float:
        return self.manifest["created"]


@dataclass(frozen=True)
class Lookup:
    artifact: Artifact | None
    reason: str = ""  # why this is a miss; empty on a hit

    @property
    def hit(self) -> bool:
        return self.artifact is not None


@dataclass
class Built:
    """What a build function may report besides the files it wrote into out_dir."""

    info: dict[str, Any] = field(default_factory=dict)  # counts, timings: recorded, not digested
    refs: dict[str, dict[str, Any]] = field(default_factory=dict)  # root-relative path -> size, digest


@dataclass(frozen=True)
class WorkDir:
    """A resumable work directory, as `gc` sees it."""

    stage: str
    work_key: str
    modified: float  # the newest change in it
    bytes: int


class ArtifactStore:
    """Artifacts in a local folder. ObjectArtifactStore (cache/object_store.py) keeps them on object
    storage behind the same methods."""

    def __init__(self, root: Path):
        self.root = Path(root).resolve()

    @property
    def location(self) -> str:
        """Where the cache is, as messages name it."""
        return str(self.root)

    # ---- layout
    def artifact_dir(self, stage: str, key: str) -> Path:
        return self.root / stage / key

    def work_dir(self, stage: str, work_key: str) -> Path:
        return self.root / "work" / stage / work_key

    def lock(self, stage: str, work_key: str, on_wait: Callable[[], None] | None = None, wait: bool = True):
        """The lock of everything built from one work directory (see the module's docstring). As a
        context manager it yields whether it is held (with wait=False it may not be)."""
        return key_lock(self.root / "locks" / stage / f"{work_key}.lock", on_wait, wait)

    def sample_store(self) -> SampleStore:
        return SampleStore(self.root)

    def ensure_usable(self) -> None:
        """Raise CacheRootError, one line naming the path, unless the root and the folders it
        keeps can be created and written (a file in their place, read-only, full, no permission)."""
        for path in (self.root, *(self.root / name for name in RESERVED)):
            if path.exists() and not path.is_dir():
                raise CacheRootError(f"{path} is a file where the cache keeps a folder: move it away,"
                                     " or set cache_dir to another folder")
        try:
            probe_writable(self.root / "tmp")
        except OSError as error:
            raise CacheRootError(unusable_folder("cache_dir", self.root, error)) from error

    def writable(self) -> bool:
        """Whether this process may write in the cache folder, or make it (not on a read-only
        filesystem, nor without the permission)."""
        existing = next(folder for folder in (self.root, *self.root.parents) if folder.exists())
        return os.access(existing, os.W_OK)

    # ---- reading
    def lookup(self, stage: str, key: str) -> Lookup:
        """Cheap check: manifest parses, every listed file exists with its listed size."""
        path = self.artifact_dir(stage, key)
        manifest_path = path / MANIFEST
        if not path.exists():
            return Lookup(None, "no artifact with this key")
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, ValueError):
            return Lookup(None, f"{manifest_path} is missing or unreadable")
        if manifest.get("key") != key:
            return Lookup(None, f"{manifest_path} belongs to another key")
        for rel, entry in manifest["files"].items():
            problem = _size_problem(path / rel, entry["size"])
            if problem:
                return Lookup(None, problem)
        for rel, entry in manifest.get("refs", {}).items():
            problem = _size_problem(self.root / rel, entry["size"])
            if problem:
                return Lookup(None, problem)
        return Lookup(Artifact(stage, key, path, manifest))

    def verify(self, artifact: Artifact, hashed: dict[Path, str] | None = None) -> list[str]:
        """Thorough check: re-hash every file and referenced file. Pass one `hashed` dict to a
        series of calls so a file that several artifacts reference (a shard) is read once."""
        hashed = {} if hashed is None else hashed
        problems = []
        listed = [(artifact.path / rel, e) for rel, e in artifact.manifest["files"].items()]
        listed += [(self.root / rel, e) for rel, e in artifact.manifest.get("refs", {}).items()]
        for path, entry in listed:
            problem = _size_problem(path, entry["size"])
            if not problem and path not in hashed:
                hashed[path] = digest_file(path)
            if not problem and hashed[path] != entry["digest"]:
                problem = f"{path} does not match its recorded digest"
            if problem:
                problems.append(problem)
        return problems

    def artifacts(self) -> Iterator[Artifact]:
        for stage_dir in sorted(p for p in self.root.iterdir() if p.is_dir()):
            if stage_dir.name in RESERVED:
                continue
            for key_dir in sorted(p for p in stage_dir.iterdir() if p.is_dir()):
                if key_dir.name.startswith("."):
                    continue
                found = self.lookup(stage_dir.name, key_dir.name)
                if found.artifact:
                    yield found.artifact

    # ---- writing
    def build(
        self,
        stage_key: StageKey,
        build: Callable[[Path, Path], Built | None],
        producer: dict[str, Any],
        log: Callable[[str], None] = print,
        force: bool = False,
    ) -> tuple[Artifact, bool]:
        """Return (artifact, computed). Builds under the lock unless a valid artifact exists.

        force: discard the artifact and the work directory and build again, unless another run
        published a new artifact of this key while this one waited for the lock: two runs forced
        at once rebuild once, and the second uses the first one's fresh artifact."""
        stage, key = stage_key.stage, stage_key.key
        seen = self.lookup(stage, key)
        if seen.hit and not force:
            return seen.artifact, False
        wait_msg = f"{stage}: another run is building {key[:12]} (or from its work directory); waiting for it"
        with self.lock(stage, stage_key.work_key, on_wait=lambda: log(wait_msg)) as held:
            found = self.lookup(stage, key)
            if found.hit and not (force and _same_build(found.artifact, seen.artifact)):
                return found.artifact, False
            if force:
                if found.artifact:
                    self._discard(found.artifact)
                self._discard_work(stage, stage_key.work_key)
            with naming_a_full_disk(self.root):  # a build's writes go into its out and work dirs, in here
                return self._build_locked(stage_key, build, producer, held, log), True

    def _build_locked(self, stage_key: StageKey, build, producer, held, log) -> Artifact:
        stage, key = stage_key.stage, stage_key.key
        tmp_root = self.root / "tmp" / stage
        tmp_root.mkdir(parents=True, exist_ok=True)
        for stale in tmp_root.glob(f"{key}.*"):  # left by a killed builder of this key
            shutil.rmtree(stale, ignore_errors=True)
        out_dir = tmp_root / f"{key}.{os.getpid()}"
        out_dir.mkdir()
        work_dir = self.work_dir(stage, stage_key.work_key)
        work_dir.mkdir(parents=True, exist_ok=True)
        started = time.time()
        built = build(out_dir, work_dir) or Built()
        manifest = _manifest(stage_key, out_dir, built, producer, time.time() - started)
        write_json_atomic(out_dir / MANIFEST, manifest)
        fsync_tree(out_dir)
        final = self.artifact_dir(stage, key)
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_tree(final)  # a damaged artifact of this key, already reported as a miss
        os.replace(out_dir, final)
        if not stage_key.resumable:  # a resumable stage's work dir serves its extensions (more steps)
            self._discard_work(stage, stage_key.work_key)
        return Artifact(stage, key, final, manifest)

    def _discard(self, artifact: Artifact) -> None:
        remove_tree(Path(artifact.location))

    def _discard_work(self, stage: str, work_key: str) -> None:
        shutil.rmtree(self.work_dir(stage, work_key), ignore_errors=True)

    def remove(self, artifact: Artifact, wait: bool = True, on_wait: Callable[[], None] | None = None) -> bool:
        """Remove a published artifact under its lock, so that a run building it (or from its work
        directory) finishes first. With wait=False a busy artifact is left alone: returns False."""
        with self.lock(artifact.stage, artifact.work_key, on_wait, wait) as held:
            if held:
                self._discard(artifact)
            return bool(held)

    def remove_work_dir(self, stage: str, work_key: str) -> bool:
        """Remove a work directory unless a run is using it (its lock is held): returns whether it was."""
        with self.lock(stage, work_key, wait=False) as held:
            if held:
                self._discard_work(stage, work_key)
            return bool(held)

    def work_dirs(self) -> list[WorkDir]:
        found = []
        for work in sorted((self.root / "work").glob("*/*")):
            entries = [work, *work.rglob("*")]
            found.append(WorkDir(work.parent.name, work.name, max(e.stat().st_mtime for e in entries),
                                 sum(e.stat().st_size for e in entries if e.is_file())))
        return found

    def sweep(self, before: float) -> None:
        """Remove what interrupted removals (and, on object storage, uploads older than `before`) left."""
        for trash in self.root.rglob(".trash-*"):
            shutil.rmtree(trash, ignore_errors=True)

    # ---- what each pipeline last used (for miss reasons, `cache ls` and gc)
    def remember(self, pipeline: str, stage_key: StageKey, artifact: Artifact) -> None:
        refs_path = self.root / "refs" / f"{pipeline}.json"
        uses = self.root / "uses" / stage_key.stage / f"{artifact.key}.jsonl"
        with naming_a_full_disk(self.root):
            refs_path.parent.mkdir(parents=True, exist_ok=True)
            with key_lock(refs_path.with_suffix(".lock")):
                refs = json.loads(refs_path.read_text()) if refs_path.exists() else {}
                refs[stage_key.stage] = {"key": stage_key.key, "ingredients": stage_key.ingredients}
                write_json_atomic(refs_path, refs)
            uses.parent.mkdir(parents=True, exist_ok=True)
            with open(uses, "a") as f:
                f.write(json.dumps({"pipeline": pipeline, "time": time.time()}) + "\n")

    def previous(self, pipeline: str, stage: str) -> dict[str, Any] | None:
        refs_path = self.root / "refs" / f"{pipeline}.json"
        if not refs_path.exists():
            return None
        return json.loads(refs_path.read_text()).get(stage)

    def pipeline_refs(self) -> dict[str, dict[str, dict[str, Any]]]:
        """pipeline -> stage -> the key (and its ingredients) of the artifact it used last."""
        return {path.stem: json.loads(path.read_text()) for path in sorted((self.root / "refs").glob("*.json"))}

    def uses(self, artifact: Artifact) -> list[dict[str, Any]]:
        path = self.root / "uses" / artifact.stage / f"{artifact.key}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line]

    def record_run(self, pipeline: str, run: str, keys: dict[str, str]) -> None:
        """Append one completed run (its name and the artifact key of each stage it used)."""
        path = self.root / RUNS_DIR / f"{pipeline}.jsonl"
        with naming_a_full_disk(self.root):
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:  # one short O_APPEND write: concurrent runs do not interleave
                f.write(json.dumps({"run": run, "time": time.time(), "keys": keys}) + "\n")

    def runs(self) -> dict[str, list[dict[str, Any]]]:
        """pipeline -> its completed runs, oldest first."""
        runs = {}
        for path in sorted((self.root / RUNS_DIR).glob("*.jsonl")):
            rows = [json.loads(line) for line in path.read_text().splitlines() if line]
            runs[path.stem] = sorted(rows, key=lambda r: r["time"])
        return runs


def _same_build(found: Artifact, seen: Artifact | None) -> bool:
    """Whether `found` is the very artifact seen before waiting for the lock (not a rebuild)."""
    return seen is not None and found.created == seen.created and found.digest == seen.digest


def _size_problem(path: Path, size: int) -> str:
    if not path.is_file():
        return f"{path} is missing"
    actual = path.stat().st_size
    if actual != size:
        return f"{path} has {actual} bytes, its manifest says {size}"
    return ""


def _manifest(stage_key: StageKey, out_dir: Path, built: Built, producer: dict, seconds: float) -> dict:
    files = {}
    for path in sorted(p for p in out_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(out_dir).as_posix()
        files[rel] = {"size": path.stat().st_size, "digest": digest_file(path)}
    data = {rel: e["digest"] for rel, e in files.items() if not rel.startswith(UNDIGESTED)}
    return {
        "format": FORMAT,
        "stage": stage_key.stage,
        "key": stage_key.key,
        "work_key": stage_key.work_key,
        "ingredients": stage_key.ingredients,
        "digest": digest_json(data),
        "files": files,
        "refs": built.refs,
        "info": built.info,
        "producer": {**producer, "host": socket.gethostname(), "seconds": round(seconds, 3)},
        "created": time.time(),
    }


def diff_ingredients(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted paths of the ingredients that differ between two key ingredient trees."""
    if isinstance(old, dict) and isinstance(new, dict):
        changed = []
        for name in sorted(set(old) | set(new)):
            path = f"{prefix}.{name}" if prefix else name
            if name not in old or name not in new:
                changed.append(path)
            else:
                changed += diff_ingredients(old[name], new[name], path)
        return changed
    return [] if old == new else [prefix or "(root)"]
