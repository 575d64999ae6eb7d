"""Which errors are the user's, and their one line (cache/errors.py), on errors real system calls
raise: a file where a folder belongs, a full disk (/dev/full, a full tmpfs), a database that cannot
be opened. A bug stays a bug."""
from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from lorapipe.cache.errors import UserError, user_message
from lorapipe.cache.store import ArtifactStore, Built, StageKey
from lorapipe.flows.config import load_config
from lorapipe.flows.outputs import finish_run
from mounts import fill, tmpfs

REPO = Path(__file__).resolve().parent.parent


def raised(action) -> BaseException:
    with pytest.raises(Exception) as caught:
        action()
    return caught.value


def test_a_file_where_a_folder_belongs_names_that_file(tmp_path):
    (tmp_path / "locks").write_text("")
    error = raised(lambda: (tmp_path / "locks" / "train" / "k.lock").parent.mkdir(parents=True, exist_ok=True))
    assert user_message(error) == f"{tmp_path / 'locks'} is a file where a folder is expected: move it away"
    error = raised(lambda: open(tmp_path / "locks" / "k.lock", "w"))
    assert user_message(error) == f"{tmp_path / 'locks'} is a file where a folder is expected: move it away"


def test_a_full_disk_says_so_even_when_the_write_names_no_file():
    def write_to_a_full_disk():
        with open("/dev/full", "wb") as f:
            f.write(b"x")

    message = user_message(raised(write_to_a_full_disk))
    assert message.startswith("No space left on device: the disk is full") and "cache gc" in message


def test_every_write_on_a_full_disk_names_the_folder_it_writes_in(tmp_path):
    """Not only a build's: a run after a disk filled up used to fail recording what it served
    ("No space left on device" and no path), as writes name no file."""
    def build(out: Path, work: Path) -> Built:
        (out / "x.bin").write_bytes(b"data")
        return Built()

    with tmpfs(tmp_path / "disk", "size=64k") as disk:
        store, key = ArtifactStore(disk / "cache"), StageKey("demo", {"stage": "demo"})
        artifact, _ = store.build(key, build, {})
        store.remember("demo", key, artifact)
        (disk / "out").mkdir()
        fill(disk)
        full_cache = f"{store.root}: the disk is full"
        assert user_message(raised(lambda: store.build(StageKey("demo", {"n": 2}), build, {}))).startswith(full_cache)
        assert user_message(raised(lambda: store.remember("demo", key, artifact))).startswith(full_cache)
        assert user_message(raised(lambda: store.record_run("demo", "second", {"demo": key.key}))).startswith(full_cache)
        summary = raised(lambda: finish_run(disk / "out", load_config(REPO / "configs" / "demo.yaml"), [], "second",
                                            log=lambda line: None, record=False))
        assert user_message(summary).startswith(f"{disk / 'out'}: the disk is full")


def test_a_stat_cache_that_cannot_be_opened_is_one_line(tmp_path):
    (tmp_path / "cache").write_text("")
    error = raised(lambda: sqlite3.connect(tmp_path / "cache" / "stat-cache.sqlite").execute("select 1"))
    assert "stat-cache.sqlite" in user_message(error) and "\n" not in user_message(error)


def test_user_errors_are_one_line_and_bugs_are_not_the_users():
    assert user_message(UserError("first\nsecond")) == "first; second"
    assert user_message(raised(lambda: Path(None))) is None  # TypeError: a bug
    assert user_message(OSError(5, "Input/output error", "/x")) is None  # not one we know how to advise on
