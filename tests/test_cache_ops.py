"""`lorapipe cache ls | verify | rm | gc` on a real store: what each prints, what gc keeps
(the last N runs' artifacts, what is newer than a date, every pipeline's latest), what it frees,
and a one-line error for every bad input."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from lorapipe.cache.store import ArtifactStore, Built, StageKey
from lorapipe.flows.cli import main

DAY = 86400


def _artifact(store: ArtifactStore, stage: str, name: str, size: int, age_days: float = 0) -> StageKey:
    def build(out: Path, work: Path) -> Built:
        (out / "data.bin").write_bytes(name.encode() * size)
        return Built()

    key = StageKey(stage, {"stage": stage, "name": name})
    artifact, _ = store.build(key, build, {})
    if age_days:  # pretend it was made (and last used) that long ago
        manifest = json.loads((artifact.path / "manifest.json").read_text())
        manifest["created"] = time.time() - age_days * DAY
        (artifact.path / "manifest.json").write_text(json.dumps(manifest))
    return key


def _use(store: ArtifactStore, pipeline: str, run: str, keys: list[StageKey]) -> None:
    for key in keys:
        store.remember(pipeline, key, store.lookup(key.stage, key.key).artifact)
    store.record_run(pipeline, run, {key.stage: key.key for key in keys})


@pytest.fixture
def store(tmp_path) -> ArtifactStore:
    """Pipeline `p` ran three times (train a, b, c; encode e1 then e2), each artifact 30 days old."""
    store = ArtifactStore(tmp_path / "cache")
    keys = {n: _artifact(store, stage, n, 100, age_days=30) for stage, n in
            [("encode", "e1"), ("encode", "e2"), ("train", "a"), ("train", "b"), ("train", "c")]}
    for run, (e, t) in {"run-1": ("e1", "a"), "run-2": ("e1", "b"), "run-3": ("e2", "c")}.items():
        _use(store, "p", run, [keys[e], keys[t]])
    for uses in (store.root / "uses").rglob("*.jsonl"):  # ... and so were those runs
        rows = [json.loads(line) for line in uses.read_text().splitlines()]
        uses.write_text("".join(json.dumps({**r, "time": r["time"] - 30 * DAY}) + "\n" for r in rows))
    store.keys = {name: key.key for name, key in keys.items()}  # for the tests: name -> key
    return store


def _cache(capsys, store: ArtifactStore, *args: str) -> tuple[int, str, str]:
    code = main(["cache", *args, "--cache-dir", str(store.root)])
    out, err = capsys.readouterr()
    return code, out, err


def _present(store: ArtifactStore) -> set[str]:
    names = {key: name for name, key in store.keys.items()}
    return {names[a.key] for a in store.artifacts()}


def test_ls_lists_stage_key_size_dates_and_the_runs_that_used_each(capsys, store):
    code, out, _ = _cache(capsys, store, "ls", "--json")
    rows = {r["key"]: r for r in json.loads(out)}
    assert code == 0 and len(rows) == 5
    e1 = rows[store.keys["e1"]]
    assert e1["stage"] == "encode" and e1["bytes"] == 200 and e1["runs"] == ["run-1", "run-2"]
    assert e1["pipelines"] == ["p"] and time.time() - e1["last_used"] > 29 * DAY
    code, out, _ = _cache(capsys, store, "ls")
    assert code == 0 and store.keys["c"][:12] in out and "run-3 (p)" in out


def test_gc_keeps_what_the_last_runs_used_and_reports_what_it_freed(capsys, store):
    code, out, _ = _cache(capsys, store, "gc", "--keep-last", "2")
    assert code == 0 and _present(store) == {"e1", "e2", "b", "c"}
    assert f"removed train/{store.keys['a']}" in out
    assert "removed 1 artifacts, 0 shards and 0 work directories, freed 100 bytes" in out
    code, out, _ = _cache(capsys, store, "gc", "--keep-last", "1")
    assert _present(store) == {"e2", "c"} and "freed 300 bytes" in out


def test_gc_keeps_what_is_newer_than_a_date(capsys, store):
    store.keys["fresh"] = _artifact(store, "train", "fresh", 10).key
    yesterday = time.strftime("%Y-%m-%d", time.localtime(time.time() - DAY))
    code, out, _ = _cache(capsys, store, "gc", "--since", yesterday)
    assert code == 0 and _present(store) == {"e2", "c", "fresh"} and "removed 3 artifacts" in out


def test_gc_keep_days_zero_keeps_only_each_pipelines_latest(capsys, store):
    code, out, _ = _cache(capsys, store, "gc", "--keep-days", "0")
    assert code == 0 and _present(store) == {"e2", "c"} and "removed 3 artifacts" in out


def test_gc_drops_the_training_work_of_removed_artifacts_and_keeps_the_latest(capsys, tmp_path):
    import os

    store = ArtifactStore(tmp_path / "cache")

    def build(out: Path, work: Path) -> Built:
        (work / "checkpoint.bin").write_bytes(b"x" * 50)
        (out / "lora.bin").write_bytes(work.name.encode())
        return Built()

    old, new = (StageKey("train", {"lr": lr, "steps": 10}, resumable=("steps",)) for lr in (1, 2))
    for key in (old, new):
        store.build(key, build, {})
    _use(store, "p", "run-1", [new])
    for work in (store.root / "work").rglob("*"):
        os.utime(work, (time.time() - 2 * DAY,) * 2)
    code, out, _ = _cache(capsys, store, "gc", "--keep-days", "0")
    assert code == 0 and "1 work directories" in out
    assert not store.work_dir("train", old.work_key).exists()
    assert (store.work_dir("train", new.work_key) / "checkpoint.bin").exists()


def test_verify_rehashes_and_names_the_damaged_file(capsys, store):
    code, out, _ = _cache(capsys, store, "verify")
    assert code == 0 and out.count("  ok\n") == 5
    damaged = store.root / "train" / store.keys["b"] / "data.bin"
    damaged.write_bytes(b"x" * damaged.stat().st_size)  # same size: only a re-hash notices
    code, out, _ = _cache(capsys, store, "verify")
    assert code == 1 and f"DAMAGED: {damaged} does not match its recorded digest" in out


def test_rm_removes_by_key_prefix(capsys, store):
    code, out, _ = _cache(capsys, store, "rm", store.keys["a"][:10])
    assert code == 0 and out == f"removed train {store.keys['a']}\n" and "a" not in _present(store)


@pytest.mark.parametrize("args, message", [
    (["rm"], "cache rm needs one or more artifact keys"),
    (["rm", "ffffffffzz"], "cache rm: no artifact key starts with 'ffffffffzz'"),
    (["gc", "--since", "last tuesday"], "cache gc: --since: 'last tuesday' is not a date"),
    (["gc", "--since", "2026-01-01", "--keep-days", "3"], "cache gc: give --since or --keep-days, not both"),
    (["gc", "--keep-last", "-1"], "cache gc: --keep-last must be 0 or more"),
])
def test_bad_cache_arguments_get_one_line_naming_the_option(capsys, store, args, message):
    code, out, err = _cache(capsys, store, *args)
    assert code == 1 and err.startswith(f"lorapipe: error: {message}") and err.count("\n") == 1
    assert len(_present(store)) == 5


def test_a_missing_cache_folder_is_one_line(capsys, tmp_path):
    code = main(["cache", "ls", "--cache-dir", str(tmp_path / "nowhere")])
    err = capsys.readouterr().err
    assert code == 1 and "nowhere does not exist" in err and err.count("\n") == 1
