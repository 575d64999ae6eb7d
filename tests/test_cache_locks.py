"""Every destructive step holds the lock of what it touches (issue 12, item 7), with real processes:
a forced rebuild, two builds that share a work directory (train keys differing in max_steps),
`cache rm` and `cache gc` all wait for (or leave alone) a build in progress. No diffusion involved."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from builders import finished, marker_lines

from lorapipe.cache.gc import collect
from lorapipe.cache.store import ArtifactStore, StageKey
from lorapipe.flows.cli import main

REPO = Path(__file__).resolve().parent.parent
BUILDER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from lorapipe.cache.store import ArtifactStore, StageKey
    root, marker, name, params, force, sleep = sys.argv[1:]
    def build(out, work):
        with open(marker, "a") as f:
            f.write(f"start {name}\\n")
        time.sleep(float(sleep))
        (out / "x").write_text(name)
        with open(marker, "a") as f:
            f.write(f"end {name}\\n")
    key = StageKey("demo", {"stage": "demo", "params": json.loads(params)}, resumable=("params.steps",))
    forced = {"force": True} if force == "force" else {}
    artifact, computed = ArtifactStore(Path(root)).build(key, build, {}, log=lambda m: print(m, flush=True), **forced)
    print("computed" if computed else "waited", flush=True)
""")


def _key(**params) -> StageKey:
    return StageKey("demo", {"stage": "demo", "params": params}, resumable=("params.steps",))


def _builder(tmp_path: Path, name: str, params: dict, force: bool = False, sleep: float = 0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BUILDER, str(tmp_path / "cache"), str(tmp_path / "marker"), name,
                             json.dumps(params), "force" if force else "", str(sleep)],
                            cwd=REPO, stdout=subprocess.PIPE, text=True)


def _wait_for_line(tmp_path: Path, line: str, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while line not in marker_lines(tmp_path):
        assert time.time() < deadline, f"{line!r} never appeared"
        time.sleep(0.05)


def test_two_forced_rebuilds_at_once_rebuild_once_and_the_second_uses_the_first(tmp_path):
    store = ArtifactStore(tmp_path / "cache")
    finished(_builder(tmp_path, "old", {"a": 1}))
    old = store.lookup("demo", _key(a=1).key).artifact
    first = _builder(tmp_path, "first", {"a": 1}, force=True, sleep=2)
    _wait_for_line(tmp_path, "start first")  # the first holds the lock and has discarded the old artifact
    second = _builder(tmp_path, "second", {"a": 1}, force=True)
    out_first, out_second = finished(first), finished(second)
    assert out_first.strip().endswith("computed")
    assert "waiting" in out_second and out_second.strip().endswith("waited")
    assert marker_lines(tmp_path) == ["start old", "end old", "start first", "end first"]
    rebuilt = store.lookup("demo", _key(a=1).key).artifact
    assert (rebuilt.path / "x").read_text() == "first" and rebuilt.created > old.created
    assert store.verify(rebuilt) == []


def test_a_forced_rebuild_after_another_has_finished_rebuilds_again(tmp_path):
    for name in ("old", "first", "second"):
        finished(_builder(tmp_path, name, {"a": 1}, force=name != "old"))
    assert [line for line in marker_lines(tmp_path) if line.startswith("start")] == ["start old", "start first",
                                                                                "start second"]


def test_keys_that_share_a_work_directory_build_one_at_a_time(tmp_path):
    assert _key(a=1, steps=10).work_key == _key(a=1, steps=20).work_key  # train: max_steps is not in it
    first = _builder(tmp_path, "ten", {"a": 1, "steps": 10}, sleep=2)
    _wait_for_line(tmp_path, "start ten")
    second = _builder(tmp_path, "twenty", {"a": 1, "steps": 20})
    finished(first)
    finished(second)
    assert marker_lines(tmp_path) == ["start ten", "end ten", "start twenty", "end twenty"]


def test_cache_rm_waits_for_a_build_from_the_same_work_directory(tmp_path, capsys):
    store = ArtifactStore(tmp_path / "cache")
    finished(_builder(tmp_path, "ten", {"a": 1, "steps": 10}))
    running = _builder(tmp_path, "twenty", {"a": 1, "steps": 20}, sleep=2)
    _wait_for_line(tmp_path, "start twenty")
    assert main(["cache", "rm", _key(a=1, steps=10).key[:12], "--cache-dir", str(store.root)]) == 0
    assert "waiting for it" in capsys.readouterr().out
    assert marker_lines(tmp_path)[-1] == "end twenty"  # rm went on only once the build had finished
    finished(running)
    assert not store.lookup("demo", _key(a=1, steps=10).key).hit and store.lookup("demo", _key(a=1, steps=20).key).hit


def test_gc_leaves_alone_what_a_running_build_uses(tmp_path):
    store = ArtifactStore(tmp_path / "cache")
    finished(_builder(tmp_path, "ten", {"a": 1, "steps": 10}))  # unreferenced: gc would remove it...
    month_ago = time.time() - 30 * 86400
    manifest_path = store.lookup("demo", _key(a=1, steps=10).key).artifact.path / "manifest.json"
    manifest_path.write_text(json.dumps({**json.loads(manifest_path.read_text()), "created": month_ago}))
    work = store.work_dir("demo", _key(a=1).work_key)
    (work / "checkpoint").write_text("step 10")
    for path in (work, work / "checkpoint"):
        os.utime(path, (month_ago, month_ago))
    running = _builder(tmp_path, "twenty", {"a": 1, "steps": 20}, sleep=2)  # ...but this build uses its work dir
    _wait_for_line(tmp_path, "start twenty")
    freed = collect(store, keep_since=time.time())
    assert freed.removed == [] and freed.work_dirs == 0 and (work / "checkpoint").exists()
    assert store.lookup("demo", _key(a=1, steps=10).key).hit
    finished(running)
    assert "demo/" + _key(a=1, steps=10).key in collect(store, keep_since=time.time()).removed
