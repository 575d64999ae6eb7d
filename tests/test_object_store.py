"""The cache on object storage, against a real S3 server (SeaweedFS, started once per session):
conditional publish, a writer killed mid-upload, leases taken over from a killed or stalled holder
along with its work directory, the shard cache, and `lorapipe cache ls|verify|rm|gc`. Builders
run as real processes; no diffusion involved."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from builders import finished, marker_lines

from lorapipe.cache.gc import collect
from lorapipe.cache.object_store import MARKER, STORE_ID, ObjectArtifactStore, ObjectSettings, default_local_dir
from lorapipe.cache.objects import OPTIONS_ENV, ObjectRoot
from lorapipe.cache.samples import DamagedRecord
from lorapipe.cache.store import Built, StageKey
from lorapipe.flows.cli import main

# Leases of LEASE seconds renewed by processes that must keep to them: alone, after the parallel tests
pytestmark = pytest.mark.serial

REPO = Path(__file__).resolve().parent.parent
LEASE = 2.0  # seconds: a killed holder's lease is taken over ~2.5 s after the waiter first sees it
BUILDER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from lorapipe.cache.object_store import ObjectArtifactStore, ObjectSettings
    from lorapipe.cache.store import StageKey
    url, local, marker, name, sleep, lease, big = sys.argv[1:]
    def note(line):
        with open(marker, "a") as f:
            f.write(line + "\\n")
    def build(out, work):
        seen = sorted(p.name for p in work.iterdir() if not p.name.startswith("."))
        note(f"start {name} found {','.join(seen) or '-'}")
        (work / f"from-{name}").write_text(name)
        time.sleep(float(sleep))
        (out / "x").write_text(name)
        if int(big):  # uploading this takes a while: long enough to be killed in the middle
            for i in range(4):
                (out / f"big-{i}").write_bytes(bytes([i]) * (16 << 20))
        note(f"end {name}")
    store = ObjectArtifactStore(url, ObjectSettings(Path(local), 1 << 30, float(lease)))
    key = StageKey("demo", {"stage": "demo", "n": 1, "steps": 5}, resumable=("steps",))
    artifact, computed = store.build(key, build, {}, log=lambda m: print(m, flush=True))
    print("computed" if computed else "waited", (artifact.path / "x").read_text(), flush=True)
""")
KEY = StageKey("demo", {"stage": "demo", "n": 1, "steps": 5}, resumable=("steps",))


@pytest.fixture
def root(s3_server, tmp_path) -> str:
    return s3_server.url(f"store-{uuid.uuid4().hex[:8]}")


def _store(root: str, local: Path, lease: float = LEASE, shard_cache: int = 1 << 30, log=print) -> ObjectArtifactStore:
    return ObjectArtifactStore(root, ObjectSettings(local, shard_cache, lease), log)


def _builder(root: str, tmp_path: Path, name: str, sleep: float = 0, big: bool = False) -> subprocess.Popen:
    """A process (a host of its own: its own local side) building KEY."""
    return subprocess.Popen([sys.executable, "-c", BUILDER, root, str(tmp_path / f"host-{name}"),
                             str(tmp_path / "marker"), name, str(sleep), str(LEASE), str(int(big))],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})


def _wait(what, timeout: float = 60, message: str = "") -> None:
    deadline = time.time() + timeout
    while not what():
        assert time.time() < deadline, message
        time.sleep(0.02)


def test_the_manifest_is_a_conditional_write_a_second_writer_cannot_overwrite(root):
    objects = ObjectRoot(root)
    assert objects.put_new("demo/k/manifest.json", b"first")
    assert not objects.put_new("demo/k/manifest.json", b"second")
    assert objects.get("demo/k/manifest.json") == b"first"


def test_a_writer_killed_mid_upload_leaves_nothing_visible_and_the_rerun_publishes(root, tmp_path, capsys):
    objects = ObjectRoot(root)
    writer = _builder(root, tmp_path, "killed", big=True)
    _wait(lambda: objects.list(f"demo/{KEY.key}/"), message="the upload never started")
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    uploaded = objects.list(f"demo/{KEY.key}/")
    assert uploaded and "manifest.json" not in uploaded  # part of it is there, without its commit marker
    store = _store(root, tmp_path / "host-check")
    assert not store.lookup("demo", KEY.key).hit and list(store.artifacts()) == []
    assert main(["cache", "ls", "--json", "--cache-dir", root]) == 0
    assert json.loads(capsys.readouterr().out) == []

    out = finished(_builder(root, tmp_path, "rerun", big=True))
    assert out.strip().endswith("computed rerun")
    artifact = store.lookup("demo", KEY.key).artifact
    assert store.verify(artifact) == [] and (artifact.path / "x").read_text() == "rerun"


def test_a_killed_lease_holder_is_taken_over_after_expiry_with_its_work_directory(root, tmp_path):
    objects = ObjectRoot(root)
    holder = _builder(root, tmp_path, "dead", sleep=120)
    _wait(lambda: "from-dead" in objects.list(f"work/demo/{KEY.work_key}/"),
          message="the holder never pushed its work directory")  # its checkpoints reached the root
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    killed = time.monotonic()
    out = finished(_builder(root, tmp_path, "taker"))
    waited = time.monotonic() - killed
    assert "another run is building" in out and "took over from" in out
    assert out.strip().endswith("computed taker")
    assert marker_lines(tmp_path) == ["start dead found -", "start taker found from-dead", "end taker"]
    assert 1.25 * LEASE <= waited < 30
    # a resumable stage keeps its work directory, on the root too, for the next extension
    assert {"from-dead", "from-taker"} <= set(objects.list(f"work/demo/{KEY.work_key}/"))


def test_a_stalled_holder_does_not_publish_over_the_run_that_took_its_lease(root, tmp_path):
    stalled = _builder(root, tmp_path, "stalled", sleep=3)
    _wait(lambda: "start stalled found -" in marker_lines(tmp_path), message="the first build never started")
    stalled.send_signal(signal.SIGSTOP)  # no renewals: its lease expires while it sleeps
    taker = _builder(root, tmp_path, "taker")
    try:
        out_taker = finished(taker)
    finally:
        stalled.send_signal(signal.SIGCONT)
    out_stalled = finished(stalled)
    assert out_taker.strip().endswith("computed taker")
    assert "another run took over this run's lease" in out_stalled and out_stalled.strip().endswith("taker")
    store = _store(root, tmp_path / "host-check")
    artifact = store.lookup("demo", KEY.key).artifact
    assert (artifact.path / "x").read_text() == "taker" and store.verify(artifact) == []


def test_local_state_of_an_emptied_prefix_is_set_aside_never_taken_for_damage(root, tmp_path):
    local = tmp_path / "host"

    def checkpoint(out: Path, work: Path) -> None:
        (work / "checkpoints" / "step-000002").mkdir(parents=True)
        (work / "checkpoints" / "step-000002" / "weights").write_text("old store's")
        (out / "x").write_text("old")

    _store(root, local).build(KEY, checkpoint, {})
    ObjectRoot(root).delete_prefix("")  # the user empties the prefix (or recreates the bucket)

    found, lines = [], []

    def look(out: Path, work: Path) -> None:
        found.extend(p.relative_to(work).as_posix() for p in work.rglob("*") if not p.name.startswith("."))
        (out / "x").write_text("new")

    artifact, computed = _store(root, local, log=lines.append).build(KEY, look, {}, log=lines.append)
    assert computed and found == []  # not even the folders of a checkpoint whose files the store lost
    (aside,) = (local / "set-aside").iterdir()
    assert len(lines) == 1 and f"set aside in {aside}" in lines[0] and root in lines[0]
    kept = aside / "work" / "demo" / KEY.work_key / "checkpoints" / "step-000002" / "weights"
    assert kept.read_text() == "old store's"  # moved aside, not deleted


def test_hosts_share_a_store_s_identity_and_a_local_side_serves_one_store_at_a_time(s3_server, tmp_path):
    first, second = (s3_server.url(f"store-{uuid.uuid4().hex[:8]}") for _ in range(2))

    def bound(url: str, local: Path, log=lambda line: None) -> str:
        """The identity of the store that `local` is bound to, once a run on `url` started there."""
        _store(url, local, log=log).ensure_usable()
        return json.loads((local / MARKER).read_text())["store"]

    with ThreadPoolExecutor(2) as pool:  # two hosts' first runs on a new store, at once
        ids = set(pool.map(lambda host: bound(first, tmp_path / host), ("a", "b")))
    assert len(ids) == 1 and bound(first, tmp_path / "c") in ids  # and a host that comes later
    assert json.loads(ObjectRoot(first).get(STORE_ID))["id"] in ids

    shared = tmp_path / "shared"  # object_store.local_dir set to one folder for two stores
    bound(first, shared)
    (shared / "artifacts" / "of-first").mkdir(parents=True)
    lines: list[str] = []
    assert bound(second, shared, lines.append) not in ids
    assert not (shared / "artifacts" / "of-first").exists()
    (aside,) = (shared / "set-aside").iterdir()
    assert (aside / "artifacts" / "of-first").is_dir() and len(lines) == 1 and f"set aside in {aside}" in lines[0]


def test_the_default_local_side_is_named_after_the_endpoint_too(monkeypatch):
    sides = set()
    for endpoint in ("http://127.0.0.1:9000", "http://127.0.0.1:9001"):  # the same bucket name on two stores
        monkeypatch.setenv(OPTIONS_ENV, json.dumps({"endpoint_url": endpoint}))
        sides.add(default_local_dir(ObjectRoot("s3://bucket/prefix")))
    assert len(sides) == 2 and all(side.name.startswith("bucket-") for side in sides)


def _write_shards(store: ObjectArtifactStore, count: int) -> dict[str, str]:
    """`count` shards of 2 records each (about 20 KB); returns record key -> shard."""
    samples, written = store.sample_store(), {}
    for i in range(count):
        records = {f"r{i}a": {"bin": os.urandom(8000)}, f"r{i}b": {"bin": os.urandom(8000)}}
        shard = samples.write_shard(records)
        written.update(dict.fromkeys(records, shard))
    return written


def test_records_are_read_through_a_bounded_shard_cache_keyed_by_content(root, tmp_path):
    writer = _store(root, tmp_path / "writer")
    written = _write_shards(writer, 6)
    reader_store = _store(root, tmp_path / "reader", shard_cache=50_000)  # room for 2 of the 6 shards
    reader = reader_store.sample_store()
    index = reader.index()
    assert set(index) == set(written)
    expected = {key: writer.sample_store().read(key, index[key], "bin") for key in written}
    for key in sorted(written):  # another host: downloads each shard once, then reads it locally
        assert reader.read(key, index[key], "bin") == expected[key]
    cached = list((tmp_path / "reader" / "shards").glob("*.tar"))
    assert 1 <= len(cached) <= 2 and sum(p.stat().st_size for p in cached) <= 50_000
    assert all(p.stem in set(written.values()) for p in cached)
    for path in cached:  # deleting the cache is safe: what is gone is fetched again
        path.unlink()
    key = sorted(written)[0]
    assert reader.read(key, index[key], "bin") == expected[key]


def test_a_shard_damaged_on_object_storage_is_never_served_nor_cached(root, tmp_path):
    writer = _store(root, tmp_path / "writer")
    written = _write_shards(writer, 1)
    key, shard = next(iter(written.items()))
    objects = ObjectRoot(root)
    damaged = bytearray(objects.get(f"samples/{shard}.tar"))
    offset, size, _ = writer.sample_store().index()[key].members["bin"]
    damaged[offset + size // 2] ^= 1
    objects.put(f"samples/{shard}.tar", bytes(damaged))
    reader = _store(root, tmp_path / "reader").sample_store()
    with pytest.raises(DamagedRecord, match=f"{shard}.tar: record {key} does not match"):
        reader.read(key, reader.index()[key], "bin")
    assert not (tmp_path / "reader" / "shards" / f"{shard}.tar").exists()


def _build(store: ObjectArtifactStore, name: str, refs: dict[str, str] | None = None) -> StageKey:
    def build(out: Path, work: Path) -> Built:
        (out / "data.bin").write_bytes(name.encode() * 100)
        samples = store.sample_store()
        return Built(refs={f"samples/{s}.tar": {k: samples.shard_meta(s)[k] for k in ("size", "digest")}
                           for s in (refs or {}).values()})

    key = StageKey("encode", {"stage": "encode", "name": name})
    store.build(key, build, {})
    return key


def test_cache_ls_verify_rm_and_gc_work_on_an_object_storage_root(root, tmp_path, capsys):
    store = _store(root, tmp_path / "host")
    kept_shards, dropped_shards = _write_shards(store, 1), _write_shards(store, 1)
    kept, dropped = _build(store, "kept", kept_shards), _build(store, "dropped", dropped_shards)
    doomed = _build(store, "doomed")
    store.remember("p", kept, store.lookup("encode", kept.key).artifact)
    store.record_run("p", "run-1", {"encode": kept.key})

    def cache(*args: str) -> tuple[int, str]:
        code = main(["cache", *args, "--cache-dir", root])
        return code, capsys.readouterr().out

    code, out = cache("ls", "--json")
    rows = {r["key"]: r for r in json.loads(out)}
    assert code == 0 and set(rows) == {kept.key, dropped.key, doomed.key}
    assert rows[kept.key]["runs"] == ["run-1"] and rows[kept.key]["pipelines"] == ["p"]
    assert cache("verify")[0] == 0

    code, out = cache("rm", doomed.key[:12])
    assert code == 0 and f"removed encode {doomed.key}" in out and not store.lookup("encode", doomed.key).hit

    freed = collect(store, keep_last=1, grace=0)  # what no run kept goes, and its shards with it
    assert freed.removed == [f"encode/{dropped.key}"] and freed.shards == 1
    assert store.lookup("encode", kept.key).hit and not store.lookup("encode", dropped.key).hit
    assert set(store.sample_store().index()) == set(kept_shards)

    shard = next(iter(kept_shards.values()))
    objects = ObjectRoot(root)
    objects.put(f"samples/{shard}.tar", b"\0" * len(objects.get(f"samples/{shard}.tar")))  # same size
    code, out = cache("verify")
    assert code == 1 and "does not match its recorded digest" in out and "removed, its records are re-encoded" in out
    assert not store.lookup("encode", kept.key).hit  # the shard is gone, so is the artifact that needs it


def _status_of(tmp_path: Path, capsys, monkeypatch, cache_dir: str, endpoint: str) -> str:
    """What `lorapipe status` prints on stderr for a config whose cache_dir is `cache_dir` at `endpoint`."""
    import yaml

    monkeypatch.setenv(OPTIONS_ENV, "{}")  # the config's storage_options go there: undone after the test
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({
        "cache_dir": cache_dir, "storage_options": {"endpoint_url": endpoint, "key": "k", "secret": "s"},
        "object_store": {"local_dir": str(tmp_path / "local")}, "output_dir": "out", "model": {"path": "m"},
        "data": {"path": "d"}, "train": {}, "evaluate": {"prompts": ["x"]}}))
    assert main(["status", str(config)]) == 1
    return capsys.readouterr().err


def test_an_unreachable_store_or_an_unsupported_url_is_one_line(tmp_path, capsys, monkeypatch):
    err = _status_of(tmp_path, capsys, monkeypatch, "s3://bucket/prefix", "http://127.0.0.1:9")
    assert err.startswith("lorapipe: error: cache_dir s3://bucket/prefix cannot be used: cannot reach the object")
    assert err.count("\n") == 1
    assert main(["cache", "ls", "--cache-dir", "gs://bucket/prefix"]) == 1
    err = capsys.readouterr().err
    assert "gs://bucket/prefix: only s3:// URLs" in err and err.count("\n") == 1


@pytest.mark.parametrize(("bucket", "rule"), [
    ("my bucket", "it contains ' ': a bucket name has lowercase letters, digits, dots and hyphens"),  # botocore's check
    ("Team_Bucket", "it contains 'B', 'T', '_': a bucket name has lowercase"),  # the server's
])
def test_an_invalid_bucket_name_is_one_line_naming_it_and_the_rule(s3_server, tmp_path, capsys, monkeypatch, bucket,
                                                                   rule):
    err = _status_of(tmp_path, capsys, monkeypatch, f"s3://{bucket}/prefix", s3_server.env["AWS_ENDPOINT_URL"])
    assert err.startswith(f"lorapipe: error: cache_dir s3://{bucket}/prefix cannot be used: invalid bucket name"
                          f" '{bucket}': {rule}"), err
    assert err.count("\n") == 1


class NotS3(BaseHTTPRequestHandler):
    """A web server that is not S3: every request gets `answer` (status, content type, body)."""

    answer = (404, "text/plain", "404 page not found")

    def _answer(self) -> None:
        status, content_type, body = self.answer
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body.encode())

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.mark.parametrize("answer", [(404, "text/plain", "404 page not found"), (404, "text/html", "<p>Not here</p>"),
                                    (200, "text/html", "<p>Welcome</p>")], ids=["404-text", "404-html", "200-html"])
def test_an_endpoint_that_is_not_s3_is_said_so_naming_it(tmp_path, capsys, monkeypatch, answer):
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("Answer", (NotS3,), {"answer": answer}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        err = _status_of(tmp_path, capsys, monkeypatch, "s3://bucket/prefix", endpoint)
    finally:
        server.shutdown()
        server.server_close()
    assert err.startswith(f"lorapipe: error: cache_dir s3://bucket/prefix cannot be used: {endpoint} did not answer"
                          f" as S3 (HTTP {answer[0]} "), err
    assert "no such bucket" not in err and err.count("\n") == 1


class CuttableProxy:
    """A TCP forwarder to the S3 server that can be cut (its connections closed, new ones refused)
    and restored on the same port: the store going away and coming back."""

    def __init__(self, upstream: str):
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream, self.port = (host, int(port)), 0
        self._open: set[socket.socket] = set()
        self._listening = threading.Event()
        self.restore()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def restore(self) -> None:
        listener = socket.create_server(("127.0.0.1", self.port))
        self.port = listener.getsockname()[1]
        listener.settimeout(0.05)
        self._listening.set()
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        self._listening.clear()
        for sock in list(self._open):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self, listener: socket.socket) -> None:
        with listener:
            while self._listening.is_set():
                try:
                    client = listener.accept()[0]
                except TimeoutError:
                    continue
                server = socket.create_connection(self.upstream)
                self._open |= {client, server}
                for source, sink in ((client, server), (server, client)):
                    threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        for sock in (source, sink):
            self._open.discard(sock)
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def test_a_store_unreachable_while_renewing_the_lease_is_said_so_and_the_run_publishes(s3_server, tmp_path,
                                                                                         monkeypatch):
    proxy = CuttableProxy(s3_server.env["AWS_ENDPOINT_URL"])
    monkeypatch.setenv(OPTIONS_ENV, json.dumps({"endpoint_url": proxy.url,
                                                "config_kwargs": {"retries": {"max_attempts": 2}}}))
    store = _store(s3_server.url(f"store-{uuid.uuid4().hex[:8]}"), tmp_path / "host", lease=1.0)
    renewing = f"lease locks/demo/{KEY.work_key}.lease"

    def build(out: Path, work: Path) -> None:
        proxy.cut()  # the store goes away mid-build for longer than the lease
        _wait(lambda: renewing not in {t.name for t in threading.enumerate()}, message="the lease was never given up")
        proxy.restore()
        (out / "x").write_text("built")

    lines: list[str] = []
    artifact, computed = store.build(KEY, build, {}, log=lines.append)
    assert computed and (artifact.path / "x").read_text() == "built"
    lost = [line for line in lines if "lease" in line]
    assert len(lost) == 1 and "the object store could not be reached for 1 s while renewing" in lost[0], lines
    assert "cannot reach the object store" in lost[0] and "another run took over" not in lost[0]


@pytest.mark.parametrize("cache_dir, message", [
    ("gs://bucket/prefix", "gs://bucket/prefix: only s3:// URLs"),
    ("s3://AKIAEXAMPLE:hunter2@bucket/prefix", "bucket/prefix: credentials in a URL would be written into logs"),
])
def test_a_cache_dir_that_cannot_hold_a_cache_is_a_config_error(tmp_path, capsys, cache_dir, message):
    """Exit code 2 and one line naming the key, as every config error (it was 1, found later)."""
    import yaml

    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"cache_dir": cache_dir, "output_dir": "out", "model": {"path": "m"},
                                      "data": {"path": "d"}, "train": {}, "evaluate": {"prompts": ["x"]}}))
    assert main(["status", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lorapipe: error: {config}: cache_dir: ") and message in err and err.count("\n") == 1
    assert "hunter2" not in err


def test_a_deployment_parameter_keeps_an_s3_cache_root_and_never_its_secrets():
    """What Prefect stores of a run's `config` parameter (its serialized form) has every secret of
    storage_options masked, and a config read back from Prefect drops them (the worker's
    environment supplies the credentials) while keeping the URL and the other options."""
    import yaml

    from lorapipe.flows.pipeline import pipeline

    config = yaml.safe_load((REPO / "prefect.yaml").read_text())["definitions"]["config"]
    config = {**config, "cache_dir": "s3://team-bucket/lorapipe",
              "storage_options": {"key": "AKIAEXAMPLE", "secret": "hunter2", "endpoint_url": "http://minio:9000",
                                  "client_kwargs": {"aws_session_token": "tok", "region_name": "eu-west-1"}}}
    stored = pipeline.serialize_parameters(pipeline.validate_parameters({"config": config}))
    assert "hunter2" not in json.dumps(stored) and "AKIAEXAMPLE" not in json.dumps(stored)
    assert stored["config"]["cache_dir"] == "s3://team-bucket/lorapipe"
    assert stored["config"]["storage_options"]["endpoint_url"] == "http://minio:9000"
    received = pipeline.validate_parameters(stored)["config"]  # what a worker's flow run gets
    assert received.cache_dir == "s3://team-bucket/lorapipe"
    assert received.storage_options == {"endpoint_url": "http://minio:9000", "client_kwargs": {"region_name": "eu-west-1"}}


def test_a_checkpoint_rotated_away_by_another_host_leaves_no_empty_folder_here(root, tmp_path):
    from lorapipe.cache.worksync import WorkSync

    here = WorkSync(ObjectRoot(root), "work/demo/k", tmp_path / "here")
    (tmp_path / "here" / "checkpoints" / "step-2").mkdir(parents=True)
    (tmp_path / "here" / "checkpoints" / "step-2" / "lora.safetensors").write_bytes(b"x")
    (tmp_path / "here" / "checkpoints" / "step-4").mkdir()
    (tmp_path / "here" / "checkpoints" / "step-4" / "lora.safetensors").write_bytes(b"y")
    here.push()
    ObjectRoot(root).delete(["work/demo/k/checkpoints/step-2/lora.safetensors"])  # another host rotated it
    assert here.pull() == 0
    assert sorted(p.name for p in (tmp_path / "here" / "checkpoints").iterdir()) == ["step-4"]
