"""The artifact store on object storage: `<url>/<stage>/<key>/`, committed by its manifest.

Publishing: a build writes into a local temporary folder as it does for a local cache; its files
are uploaded under the artifact's final keys, then `manifest.json` is written last with
If-None-Match: *. The manifest is the commit marker: a prefix without one does not exist (an upload
cut short is invisible; the next build overwrites it, gc removes it), and of two writers only one
publishes, the other uses what it published. A forced rebuild, `cache rm` and gc delete the
manifest first.

Locks are leases (cache/lease.py) at `locks/<stage>/<work key>.lease`. A work directory lives on
this host's disk and is mirrored to `work/<stage>/<work key>/` while its build holds the lease
(cache/worksync.py), so a run on another host resumes from its checkpoints: training writes
checkpoints with plain file I/O and renames, which object storage has not, and each checkpoint's
seal catches one whose upload was cut short.

This host's side of the cache (`local`): verified copies of the artifacts it read
(`artifacts/<stage>/<key>/`), work directories, build folders, the shard cache and shard
indexes (cache/object_samples.py), the stat cache and converted models. Any of it can be deleted.
It is bound to the store's identity, `store-id.json` under the prefix (written once with
If-None-Match by the first run, so every host reads the same; a prefix emptied or a bucket
recreated gets a new one), and by default named after the endpoint and the URL: a local side
that held another store's state (by its MARKER) has it set aside, never mixed in, nor taken for
damage (a work directory whose files the store no longer has).

Object storage has no appends, so each fact of the bookkeeping is its own object:
`refs/<pipeline>/<stage>.json` (last writer wins, as with the local file),
`uses/<stage>/<key>/<pipeline>.json` (each pipeline's last use) and `runs/<pipeline>/<time>-<id>.json`.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

from .digest import digest_bytes, digest_file
from .errors import CacheRootError, naming_a_full_disk, unusable_folder
from .fsutil import probe_writable, remove_tree, user_cache_dir
from .lease import Lease, lease_lock
from .lock import key_lock
from .object_samples import ObjectSampleStore, ShardCache
from .objects import ObjectRoot, ObjectStoreError, is_url, json_object, local_path
from .samples import SampleStore
from .store import MANIFEST, RESERVED, Artifact, ArtifactStore, Built, Lookup, StageKey, WorkDir, _manifest
from .worksync import WorkSync

MARKER = "object-root.json"  # in the local side: which object root (and store id) it belongs to (no credentials)
STORE_ID = "store-id.json"  # under the prefix: the store's identity
SET_ASIDE = "set-aside"  # in the local side: the state it held for other stores
BINDING_LOCK = ".binding.lock"


@dataclass(frozen=True)
class ObjectSettings:
    local_dir: Path | None = None  # this host's side of the cache; None: default_local_dir
    shard_cache_bytes: int = 20 << 30
    lease_seconds: float = 60.0


def default_local_dir(objects: ObjectRoot) -> Path:
    """~/.cache/lorapipe/<bucket>-<digest of the endpoint and the URL> (XDG_CACHE_HOME is honoured)."""
    return user_cache_dir() / f"{objects.bucket}-{digest_bytes(f'{objects.endpoint} {objects.url}'.encode())[:12]}"


def open_store(cache_dir: str | Path, settings: ObjectSettings | None = None,
               log: Callable[[str], None] = print) -> ArtifactStore:
    """The artifact store at `cache_dir`: a local folder (or file:// URL), or an object-storage URL
    (`log` takes its notes about this host's side)."""
    if not is_url(cache_dir):
        return ArtifactStore(local_path(cache_dir))
    return ObjectArtifactStore(str(cache_dir), settings or ObjectSettings(), log)


def open_sample_store(root: Path | str) -> SampleStore:
    """The sample store of a cache as stages are given it: a local cache folder, or the local side of
    an object-storage cache (its MARKER names the URL)."""
    marker = Path(root) / MARKER
    if not marker.is_file():
        return SampleStore(Path(root))
    spec = json.loads(marker.read_text())
    return ObjectSampleStore(Path(root), ObjectRoot(spec["url"]),
                             ShardCache(Path(root) / "shards", spec["shard_cache_bytes"]))


class ObjectArtifactStore(ArtifactStore):
    def __init__(self, url: str, settings: ObjectSettings, log: Callable[[str], None] = print):
        self.objects = ObjectRoot(url)
        self.settings, self.log = settings, log
        self.root = Path(settings.local_dir or default_local_dir(self.objects)).expanduser().resolve()
        self._marked = False

    @property
    def location(self) -> str:
        return self.objects.url

    def _url(self, stage: str, key: str) -> str:
        return self.objects.url_of(f"{stage}/{key}")

    # ---- layout
    def artifact_dir(self, stage: str, key: str) -> Path:
        """This host's copy of the artifact."""
        return self.root / "artifacts" / stage / key

    def lock(self, stage: str, work_key: str, on_wait: Callable[[], None] | None = None, wait: bool = True):
        """A lease (cache/lease.py): yields the held Lease, or None when wait=False and it is taken."""
        return lease_lock(self.objects, f"locks/{stage}/{work_key}.lease", self.settings.lease_seconds, on_wait, wait)

    def sample_store(self) -> SampleStore:
        self._mark()
        return open_sample_store(self.root)

    def ensure_usable(self) -> None:
        try:
            probe_writable(self.root / "tmp")
        except OSError as error:
            raise CacheRootError(unusable_folder("object_store.local_dir", self.root, error)) from error
        probe = f"tmp/.probe-{socket.gethostname()}-{os.getpid()}"
        try:
            self.objects.put(probe, b"probe")
            self.objects.delete([probe])
        except (OSError, CacheRootError) as error:
            reason = error.reason if isinstance(error, ObjectStoreError) else \
                "no such bucket: create it or fix the URL" if isinstance(error, FileNotFoundError) else str(error)
            raise CacheRootError(f"cache_dir {self.location} cannot be used: {reason}") from error
        self._mark()

    def _mark(self) -> None:
        """Bind the local side to this store, setting aside what it held for another, and write MARKER,
        so stages given the local side find the object root and the shard cache."""
        if self._marked:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        store_id = self._store_id()
        spec = json.dumps({"url": self.objects.url, "store": store_id,
                           "shard_cache_bytes": self.settings.shard_cache_bytes})
        marker = self.root / MARKER
        with key_lock(self.root / BINDING_LOCK):  # two runs binding it at once: the second finds it bound
            held = json_object(marker.read_bytes()) if marker.is_file() else None
            if held is not None and held.get("store") != store_id:
                self._set_aside(held, store_id)
            if not marker.is_file() or marker.read_text() != spec:
                tmp = marker.with_name(f".{MARKER}.{os.getpid()}")
                tmp.write_text(spec)
                os.replace(tmp, marker)
        self._marked = True

    def _store_id(self) -> str:
        """The store's identity: created by the first run that binds a local side to it; of two at once,
        one writes it (If-None-Match) and both read that one."""
        data = self.objects.get(STORE_ID)
        if data is None:
            self.objects.put_new(STORE_ID, json.dumps({"id": uuid.uuid4().hex, "created": time.time()}).encode())
            data = self.objects.get(STORE_ID)
        found = json_object(data)
        if not isinstance(found.get("id"), str):
            raise CacheRootError(f"{self.objects.url_of(STORE_ID)} is not the store's identity as lorapipe writes it:"
                                 " remove it (the next run writes a new one)")
        return found["id"]

    def _set_aside(self, held: dict, store_id: str) -> None:
        """Move what the local side holds for the store `held` (its MARKER) into SET_ASIDE, unused."""
        old = held.get("store") or "unknown"
        parked = self.root / SET_ASIDE / f"{old}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        parked.mkdir(parents=True)
        for entry in sorted(self.root.iterdir()):
            if entry.name not in (MARKER, SET_ASIDE, BINDING_LOCK):
                os.replace(entry, parked / entry.name)
        self.log(f"{self.root} holds what this host kept for store {old} ({held.get('url')}), but {self.location} is"
                 f" store {store_id} (its prefix was emptied or its bucket recreated, or it is another endpoint's, or"
                 f" local_dir serves two stores): set aside in {parked}, never used again; delete it when done")

    # ---- reading
    def lookup(self, stage: str, key: str) -> Lookup:
        """The manifest (one GET) and a listing of the artifact's prefix (one LIST), plus one LIST per
        1,000 objects of the sample store when it references shards."""
        url, prefix = self._url(stage, key), f"{stage}/{key}/"
        data = self.objects.get(prefix + MANIFEST)
        if data is None:
            return Lookup(None, "no artifact with this key")
        try:
            manifest = json.loads(data)
        except ValueError:
            return Lookup(None, f"{url}/{MANIFEST} is unreadable")
        if manifest.get("key") != key:
            return Lookup(None, f"{url}/{MANIFEST} belongs to another key")
        listed = self.objects.list(prefix)
        for rel, entry in manifest["files"].items():
            problem = _listed_problem(f"{url}/{rel}", listed.get(rel), entry["size"])
            if problem:
                return Lookup(None, problem)
        if manifest.get("refs"):
            shards = self.objects.list("samples/")
            for rel, entry in manifest["refs"].items():
                problem = _listed_problem(self.objects.url_of(rel), shards.get(rel.removeprefix("samples/")),
                                          entry["size"])
                if problem:
                    return Lookup(None, problem)
        return Lookup(Artifact(stage, key, url, manifest, fetch=partial(self._fetch, stage, key, manifest)))

    def _fetch(self, stage: str, key: str, manifest: dict[str, Any]) -> Path:
        """This host's copy of the artifact, downloaded and checked against its digests if need be."""
        self._mark()
        local = self.artifact_dir(stage, key)
        with naming_a_full_disk(self.root), key_lock(self.root / "locks" / "fetch" / f"{stage}-{key}.lock"):
            if _holds(local, manifest):
                return local
            tmp = self.root / "tmp" / "fetch" / f"{stage}-{key}.{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            for rel in manifest["files"]:
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            self.objects.download_many([(f"{stage}/{key}/{rel}", tmp / rel) for rel in manifest["files"]])
            for rel, entry in manifest["files"].items():
                if digest_file(tmp / rel) != entry["digest"]:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise ValueError(f"{self._url(stage, key)}/{rel} does not match its recorded digest: run"
                                     " `lorapipe cache verify`, which removes what is damaged")
            (tmp / MANIFEST).write_text(json.dumps(manifest))
            local.parent.mkdir(parents=True, exist_ok=True)
            remove_tree(local)
            os.replace(tmp, local)
        return local

    def verify(self, artifact: Artifact, hashed: dict[str, str] | None = None) -> list[str]:
        """Download and re-hash every file and referenced shard (`hashed` as in ArtifactStore.verify)."""
        hashed = {} if hashed is None else hashed
        listed = [(f"{artifact.stage}/{artifact.key}/{rel}", e) for rel, e in artifact.manifest["files"].items()]
        listed += list(artifact.manifest.get("refs", {}).items())
        problems = []
        for rel, entry in listed:
            if rel not in hashed:
                data = self.objects.get(rel)
                hashed[rel] = "" if data is None else f"{len(data)}:{digest_bytes(data)}"
            size, _, digest = hashed[rel].partition(":")
            if not size:
                problems.append(f"{self.objects.url_of(rel)} is missing")
            elif (int(size), digest) != (entry["size"], entry["digest"]):
                problems.append(f"{self.objects.url_of(rel)} does not match its recorded digest")
        return problems

    def artifacts(self) -> Iterator[Artifact]:
        for stage in self.objects.folders(""):
            if stage in RESERVED:
                continue
            for key in self.objects.folders(f"{stage}/"):
                found = self.lookup(stage, key)
                if found.artifact:
                    yield found.artifact

    # ---- writing
    def _build_locked(self, stage_key: StageKey, build, producer, held: Lease, log) -> Artifact:
        stage, key = stage_key.stage, stage_key.key
        self._mark()
        tmp_root = self.root / "tmp" / stage
        tmp_root.mkdir(parents=True, exist_ok=True)
        for stale in tmp_root.glob(f"{key}.*"):  # left by a killed builder of this key on this host
            shutil.rmtree(stale, ignore_errors=True)
        out_dir = tmp_root / f"{key}.{os.getpid()}"
        out_dir.mkdir()
        work = self._work(stage, stage_key.work_key, held.confirm)
        if held.taken_over:
            log(f"{stage}: took over from {held.taken_over.get('host')} (pid {held.taken_over.get('pid')}), whose"
                f" lease expired; going on from what its work directory holds")
        work.pull()
        work.start(every=max(1.0, self.settings.lease_seconds / 3))
        started = time.time()
        try:
            built = build(out_dir, work.local) or Built()
        finally:
            work.finish()
        manifest = _manifest(stage_key, out_dir, built, producer, time.time() - started)
        lease = held
        artifact = self._publish(stage_key, out_dir, manifest, lease, log)
        while artifact is None:  # it lost its lease (see Lease): publish only under the lease again
            log(f"{stage}: {lease.lost_because}; waiting to take the lease on {key[:12]} again to publish, unless"
                " another run has published meanwhile")
            with self.lock(stage, stage_key.work_key) as lease:
                found = self.lookup(stage, key)
                artifact = found.artifact if found.hit else self._publish(stage_key, out_dir, manifest, lease, log)
        if not stage_key.resumable:  # a resumable stage's work dir serves its extensions (more steps)
            work.remove()
        return artifact

    def _publish(self, stage_key: StageKey, out_dir: Path, manifest: dict, lease: Lease, log) -> Artifact | None:
        """Upload the files, then the manifest with If-None-Match: the commit. Each step that writes
        under the artifact's keys first confirms the lease; None when it was lost (nothing committed)."""
        stage, key = stage_key.stage, stage_key.key
        prefix = f"{stage}/{key}/"
        if not lease.confirm():
            return None
        if self.objects.get(prefix + MANIFEST) is not None:  # a damaged artifact of this key, reported as a miss
            self.objects.delete([prefix + MANIFEST])
        self.objects.upload_many([(out_dir / rel, prefix + rel) for rel in manifest["files"]])
        if not lease.confirm():
            return None
        if not self.objects.put_new(prefix + MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode()):
            log(f"{stage}: another run published {key[:12]} first; using its artifact")
            shutil.rmtree(out_dir, ignore_errors=True)
            return self.lookup(stage, key).artifact
        (out_dir / MANIFEST).write_text(json.dumps(manifest))
        local = self.artifact_dir(stage, key)
        local.parent.mkdir(parents=True, exist_ok=True)
        remove_tree(local)
        os.replace(out_dir, local)  # this host's copy: what it built is what it reads
        return Artifact(stage, key, self._url(stage, key), manifest,
                        fetch=partial(self._fetch, stage, key, manifest))

    def _work(self, stage: str, work_key: str, held: Callable[[], bool] = lambda: True) -> WorkSync:
        return WorkSync(self.objects, f"work/{stage}/{work_key}/", self.work_dir(stage, work_key), held)

    def _discard(self, artifact: Artifact) -> None:
        prefix = f"{artifact.stage}/{artifact.key}/"
        self.objects.delete([prefix + MANIFEST])  # first: the artifact stops existing at once
        self.objects.delete_prefix(prefix)
        remove_tree(self.artifact_dir(artifact.stage, artifact.key))

    def _discard_work(self, stage: str, work_key: str) -> None:
        self._work(stage, work_key).remove()

    def work_dirs(self) -> list[WorkDir]:
        grouped: dict[tuple[str, str], list] = {}
        for rel, entry in self.objects.list("work/").items():
            stage, work_key, _ = rel.split("/", 2)
            grouped.setdefault((stage, work_key), []).append(entry)
        return [WorkDir(stage, work_key, max(e.modified for e in entries), sum(e.size for e in entries))
                for (stage, work_key), entries in sorted(grouped.items())]

    def sweep(self, before: float) -> None:
        """Remove artifact uploads that were cut short: no manifest, nothing written since `before`."""
        super().sweep(before)
        for stage in self.objects.folders(""):
            if stage in RESERVED:
                continue
            for key in self.objects.folders(f"{stage}/"):
                listed = self.objects.list(f"{stage}/{key}/")
                if MANIFEST not in listed and listed and max(e.modified for e in listed.values()) < before:
                    self.objects.delete(f"{stage}/{key}/{rel}" for rel in listed)

    # ---- bookkeeping
    def remember(self, pipeline: str, stage_key: StageKey, artifact: Artifact) -> None:
        self.objects.put(f"refs/{pipeline}/{stage_key.stage}.json",
                         json.dumps({"key": stage_key.key, "ingredients": stage_key.ingredients}).encode())
        self.objects.put(f"uses/{stage_key.stage}/{artifact.key}/{pipeline}.json",
                         json.dumps({"pipeline": pipeline, "time": time.time()}).encode())

    def previous(self, pipeline: str, stage: str) -> dict[str, Any] | None:
        data = self.objects.get(f"refs/{pipeline}/{stage}.json")
        return json.loads(data) if data else None

    def pipeline_refs(self) -> dict[str, dict[str, dict[str, Any]]]:
        refs: dict[str, dict[str, dict[str, Any]]] = {}
        for rel, data in self._read_all("refs/").items():
            pipeline, stage = rel.removesuffix(".json").split("/", 1)
            refs.setdefault(pipeline, {})[stage] = data
        return refs

    def uses(self, artifact: Artifact) -> list[dict[str, Any]]:
        return list(self._read_all(f"uses/{artifact.stage}/{artifact.key}/").values())

    def record_run(self, pipeline: str, run: str, keys: dict[str, str]) -> None:
        name = f"{time.time():017.6f}-{uuid.uuid4().hex[:8]}"
        self.objects.put(f"runs/{pipeline}/{name}.json",
                         json.dumps({"run": run, "time": time.time(), "keys": keys}).encode())

    def runs(self) -> dict[str, list[dict[str, Any]]]:
        runs: dict[str, list[dict[str, Any]]] = {}
        for rel, row in self._read_all("runs/").items():
            runs.setdefault(rel.split("/", 1)[0], []).append(row)
        return {pipeline: sorted(rows, key=lambda r: r["time"]) for pipeline, rows in sorted(runs.items())}

    def _read_all(self, prefix: str) -> dict[str, Any]:
        """rel -> parsed JSON of every object under `prefix`."""
        fetched = self.objects.get_many(prefix + rel for rel in self.objects.list(prefix))
        return {rel[len(prefix):]: json.loads(data) for rel, data in sorted(fetched.items()) if data is not None}


def _listed_problem(url: str, entry, size: int) -> str:
    if entry is None:
        return f"{url} is missing"
    if entry.size != size:
        return f"{url} has {entry.size} bytes, its manifest says {size}"
    return ""


def _holds(local: Path, manifest: dict) -> bool:
    """Whether this host's copy is of this very build (a rebuild of the key gets a new copy)."""
    try:
        held = json.loads((local / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    same = (held.get("created"), held.get("digest")) == (manifest["created"], manifest["digest"])
    return same and all((local / rel).is_file() and (local / rel).stat().st_size == e["size"]
                        for rel, e in manifest["files"].items())
