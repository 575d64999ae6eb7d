"""The cache contract (DESIGN.md): atomic publish, manifest as commit marker, damaged = miss,
one writer per key, early-cutoff digests, stat-cached hashing. No diffusion involved."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lorapipe.cache.digest import StatCache
from lorapipe.cache.samples import DamagedRecord, SampleStore
from lorapipe.cache.store import ArtifactStore, Built, StageKey

REPO = Path(__file__).resolve().parent.parent


def _key(**params) -> StageKey:
    return StageKey("demo", {"stage": "demo", "params": params}, resumable=("params.steps",))


def _write(files: dict[str, bytes]):
    def build(out: Path, work: Path) -> Built:
        for rel, data in files.items():
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            (out / rel).write_bytes(data)
        return Built(info={"n": len(files)})
    return build


def test_build_publishes_a_manifest_listing_every_file(tmp_path):
    store = ArtifactStore(tmp_path)
    artifact, computed = store.build(_key(a=1), _write({"x.bin": b"abc", "logs/run.log": b"t=1"}), {})
    assert computed and (artifact.path / "manifest.json").is_file()
    assert set(artifact.manifest["files"]) == {"x.bin", "logs/run.log"}
    again, computed = store.build(_key(a=1), _write({"x.bin": b"different"}), {})
    assert not computed and again.digest == artifact.digest
    assert list((tmp_path / "tmp" / "demo").iterdir()) == []  # nothing left behind


def test_digest_ignores_logs_so_identical_data_cuts_off_downstream(tmp_path):
    one, _ = ArtifactStore(tmp_path / "a").build(_key(a=1), _write({"x": b"same", "logs/l": b"1"}), {})
    two, _ = ArtifactStore(tmp_path / "b").build(_key(a=1), _write({"x": b"same", "logs/l": b"2"}), {})
    three, _ = ArtifactStore(tmp_path / "c").build(_key(a=1), _write({"x": b"other"}), {})
    assert one.digest == two.digest != three.digest


def test_digest_leaves_out_where_the_data_is_kept_but_a_hit_needs_it(tmp_path):
    store = ArtifactStore(tmp_path)
    for name in ("old.bin", "new.bin"):
        (tmp_path / "shared").mkdir(exist_ok=True)
        (tmp_path / "shared" / name).write_bytes(b"records k1 k2")

    def build(shared: str):
        def write(out: Path, work: Path) -> Built:
            _write({"data.json": b'["k1", "k2"]', "locations/index.json": shared.encode()})(out, work)
            return Built(refs={f"shared/{shared}": {"size": 13, "digest": "d"}})
        return write

    before, _ = store.build(_key(a=1), build("old.bin"), {})
    moved, _ = store.build(_key(a=2), build("new.bin"), {})
    assert before.digest == moved.digest  # the same records, kept elsewhere
    (tmp_path / "shared" / "old.bin").unlink()
    found = store.lookup("demo", before.key)
    assert not found.hit and "old.bin is missing" in found.reason


@pytest.mark.parametrize("damage", ["truncate", "delete", "manifest"])
def test_a_damaged_artifact_is_a_miss_that_names_the_file_and_is_rebuilt(tmp_path, damage):
    store = ArtifactStore(tmp_path)
    artifact, _ = store.build(_key(a=1), _write({"x.bin": b"abcdef"}), {})
    target = artifact.path / ("manifest.json" if damage == "manifest" else "x.bin")
    if damage == "truncate":
        target.write_bytes(b"abc")
    else:
        target.unlink()
    found = store.lookup("demo", artifact.key)
    assert not found.hit and str(target) in found.reason
    rebuilt, computed = store.build(_key(a=1), _write({"x.bin": b"abcdef"}), {})
    assert computed and (rebuilt.path / "x.bin").read_bytes() == b"abcdef"


def test_verify_catches_corruption_that_keeps_the_size(tmp_path):
    store = ArtifactStore(tmp_path)
    artifact, _ = store.build(_key(a=1), _write({"x.bin": b"abcdef"}), {})
    assert store.verify(artifact) == []
    (artifact.path / "x.bin").write_bytes(b"abcdeF")
    assert store.lookup("demo", artifact.key).hit  # the cheap check cannot see it...
    assert "x.bin" in store.verify(artifact)[0]  # ...the thorough one does


BUILDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from lorapipe.cache.store import ArtifactStore, StageKey
    root, marker, sleep = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
    def build(out, work):
        with open(marker, "a") as f:
            f.write("built\\n")
        (out / "x").write_text("data")
        time.sleep(sleep)
    key = StageKey("demo", {"stage": "demo", "params": {"a": 1}})
    artifact, computed = ArtifactStore(Path(root)).build(key, build, {}, log=lambda m: print(m, flush=True))
    print("computed" if computed else "waited", flush=True)
""")


def _builder(tmp_path: Path, sleep: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BUILDER, str(tmp_path / "cache"), str(tmp_path / "marker"),
                             str(sleep)], cwd=REPO, stdout=subprocess.PIPE, text=True)


def _wait_for(path: Path, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_a_builder_killed_mid_stage_publishes_nothing_and_the_next_run_completes(tmp_path):
    victim = _builder(tmp_path, sleep=60)
    _wait_for(tmp_path / "marker")
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    store = ArtifactStore(tmp_path / "cache")
    assert not store.lookup("demo", _key(a=1).key).hit
    survivor = _builder(tmp_path, sleep=0)  # the kernel released the dead builder's lock
    assert survivor.communicate(timeout=60)[0].strip().endswith("computed")
    assert store.lookup("demo", _key(a=1).key).hit


def test_two_concurrent_builders_of_one_key_compute_it_once(tmp_path):
    first = _builder(tmp_path, sleep=2)
    _wait_for(tmp_path / "marker")
    second = _builder(tmp_path, sleep=0)
    out_first, out_second = first.communicate(timeout=60)[0], second.communicate(timeout=60)[0]
    assert out_first.strip().endswith("computed")
    assert "waiting" in out_second and out_second.strip().endswith("waited")
    assert (tmp_path / "marker").read_text().count("built") == 1


def test_work_key_leaves_out_resumable_settings_and_their_work_dir_outlives_publishing(tmp_path):
    assert _key(a=1, steps=10).key != _key(a=1, steps=20).key
    assert _key(a=1, steps=10).work_key == _key(a=1, steps=20).work_key != _key(a=2, steps=10).work_key
    store = ArtifactStore(tmp_path)

    def build(out: Path, work: Path) -> None:
        (work / "checkpoint").write_text("step 10")
        (out / "x").write_text("x")

    store.build(_key(a=1, steps=10), build, {})
    assert (store.work_dir("demo", _key(a=1, steps=20).work_key) / "checkpoint").exists()
    plain = StageKey("plain", {"a": 1})
    store.build(plain, build, {})
    assert not store.work_dir("plain", plain.work_key).exists()


def test_stat_cache_reads_a_file_only_when_its_stat_changes(tmp_path):
    image = tmp_path / "img.jpg"
    image.write_bytes(b"pixels")
    with StatCache(tmp_path / "stat.sqlite") as cache:
        first = cache.digest(image)
        assert cache.digest(image) == first and cache.hashed == 1
        os.utime(image, ns=(1, 1))  # touched, same bytes: re-read, same digest
        assert cache.digest(image) == first and cache.hashed == 2
        image.write_bytes(b"pixelz")
        assert cache.digest(image) != first
    with StatCache(tmp_path / "stat.sqlite") as reopened:  # persisted across processes
        reopened.digest(image)
        assert reopened.hashed == 0


def test_a_read_only_stat_cache_uses_the_digests_kept_and_writes_nothing(tmp_path):
    """As `lorapipe status` opens the stat cache of a cache folder it may not write."""
    kept, new = tmp_path / "data" / "kept.jpg", tmp_path / "data" / "new.jpg"
    kept.parent.mkdir()
    kept.write_bytes(b"pixels")
    with StatCache(tmp_path / "cache" / "stat.sqlite") as cache:
        digest = cache.digest(kept)
    files = {p: p.read_bytes() for p in (tmp_path / "cache").iterdir()}
    new.write_bytes(b"more pixels")
    with StatCache(tmp_path / "cache" / "stat.sqlite", read_only=True) as cache:
        assert cache.digest(kept) == digest and cache.hashed == 0
        assert cache.digest(new) == cache.digest(new) and cache.hashed == 1
    assert {p: p.read_bytes() for p in (tmp_path / "cache").iterdir()} == files
    with StatCache(tmp_path / "none" / "stat.sqlite", read_only=True) as cache:  # no database yet
        assert cache.digest(kept) == digest
    assert not (tmp_path / "none").exists()


def test_sample_store_shards_are_deterministic_and_readable_by_offset(tmp_path):
    records = {f"k{i}": {"safetensors": bytes([i]) * (100 + i), "json": b"{}"} for i in range(5)}
    a, b = SampleStore(tmp_path / "a"), SampleStore(tmp_path / "b")
    shard = a.write_shard(records)
    assert b.write_shard(records) == shard
    assert a.shard_path(shard).read_bytes() == b.shard_path(shard).read_bytes()
    fresh = SampleStore(tmp_path / "a")
    assert fresh.missing(["k1", "k9"]) == ["k9"]
    assert fresh.read("k3", fresh.index()["k3"], "safetensors") == bytes([3]) * 103
    with open(a.shard_path(shard), "r+b") as f:
        f.truncate(512)
    assert SampleStore(tmp_path / "a").missing(["k1"]) == ["k1"]  # a truncated shard's records are gone


def test_a_record_damaged_in_place_is_refused_naming_its_shard_and_key(tmp_path):
    store = SampleStore(tmp_path)
    shard = store.write_shard({f"k{i}": {"safetensors": bytes([i]) * 600, "json": b"{}"} for i in range(3)})
    location = store.index()["k1"]
    offset, size, _ = location.members["safetensors"]
    with open(store.shard_path(shard), "r+b") as f:  # same size, other bytes: only a digest sees it
        f.seek(offset + 10)
        f.write(b"\xff")
    with pytest.raises(DamagedRecord) as damaged:
        store.read("k1", location, "safetensors")
    assert (damaged.value.shard, damaged.value.key) == (shard, "k1")
    assert str(store.shard_path(shard)) in str(damaged.value) and "\n" not in str(damaged.value)
    assert store.read("k2", store.index()["k2"], "safetensors") == bytes([2]) * 600
    import pickle

    assert pickle.loads(pickle.dumps(damaged.value)).to_json() == damaged.value.to_json()


def test_shards_written_without_record_digests_get_them_once_checked(tmp_path):
    store = SampleStore(tmp_path)
    shards = [store.write_shard({f"{name}{i}": {"safetensors": bytes([i]) * 50} for i in range(2)})
              for name in ("a", "b")]
    for shard in shards:  # as an older lorapipe wrote them: offsets and sizes, no digests
        meta = store.shard_meta(shard)
        meta["records"] = {k: {e: v[:2] for e, v in m.items()} for k, m in meta["records"].items()}
        del meta["format"]
        (store.dir / f"{shard}.json").write_text(json.dumps(meta))
    damaged = bytearray(store.shard_path(shards[1]).read_bytes())
    damaged[600] ^= 1
    store.shard_path(shards[1]).write_bytes(bytes(damaged))
    old = SampleStore(tmp_path)
    with pytest.raises(DamagedRecord):  # no digest: never served unchecked
        old.read("a0", old.index()["a0"], "safetensors")
    assert old.add_member_digests(["a0", "b1", "zz"]) == (1, [(f"{shards[1]}.tar", "does not match its recorded digest")])
    assert old.missing(["a0", "a1", "b0", "b1"]) == ["b0", "b1"]
    assert old.read("a1", old.index()["a1"], "safetensors") == bytes([1]) * 50


def test_sample_store_shards_stream_through_webdataset(tmp_path):
    import webdataset

    records = {f"k{i}": {"safetensors": bytes([i]) * 10, "json": b'{"i": %d}' % i} for i in range(3)}
    store = SampleStore(tmp_path)
    shard = store.write_shard(records)
    streamed = list(webdataset.WebDataset(str(store.shard_path(shard)), shardshuffle=False, empty_check=False))
    assert [s["__key__"] for s in streamed] == ["k0", "k1", "k2"]
    assert [s["safetensors"] for s in streamed] == [records[k]["safetensors"] for k in ("k0", "k1", "k2")]


@pytest.mark.parametrize("fields,rows", [({"format": 2, "name": "x"}, [{"id": "a", "n": [1, 2]}, {"id": "b"}]),
                                         ({}, []), ({"flip": False}, [{"caption": "quote \" and\nnewline"}])])
def test_json_rows_stream_into_one_json_object_a_row_per_line(tmp_path, fields, rows):
    from lorapipe.cache.fsutil import write_json_rows

    write_json_rows(tmp_path / "index.json", fields, "samples", iter(rows))
    text = (tmp_path / "index.json").read_text()
    assert json.loads(text) == {**fields, "samples": rows}
    assert len(text.splitlines()) == len(rows) + 2  # the fields and "[", a line per row, "]}"
