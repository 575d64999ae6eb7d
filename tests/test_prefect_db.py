"""The empty, migrated Prefect database kept in the user's cache (flows/prefect_db.py): real
`lorapipe run` commands, each on a new PREFECT_HOME, with their own XDG_CACHE_HOME."""
from __future__ import annotations

import importlib.metadata
import os
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def start_run(config: Path, home: Path, xdg_cache: Path) -> subprocess.Popen:
    """`lorapipe run --only preprocess`, forced: a run with every stage cached would run no flow. Its
    cache and outputs are the home's own: two forced runs on one cache at once remove each other's
    fresh artifact, which is not what these tests are about."""
    env = {**os.environ, "PREFECT_HOME": str(home), "XDG_CACHE_HOME": str(xdg_cache)}
    env.pop("PREFECT_API_URL", None)  # the command's own temporary server
    return subprocess.Popen([sys.executable, "-m", "lorapipe.flows.cli", "run", str(config), "--only", "preprocess",
                             "--force", "preprocess",
                             "--set", f"cache_dir={home / 'cache'}", "--set", f"output_dir={home / 'out'}"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def succeeds(*runs: subprocess.Popen) -> None:
    for run in runs:
        _, stderr = run.communicate(timeout=300)
        assert run.returncode == 0, stderr[-3000:]


def rows(database: Path, query: str) -> list[tuple]:
    with closing(sqlite3.connect(database)) as db:
        return db.execute(query).fetchall()


def template_in(xdg_cache: Path) -> Path:
    return xdg_cache / "lorapipe" / f"prefect-{importlib.metadata.version('prefect')}-sqlite.db"


def test_only_prefects_default_database_in_a_new_home_is_seeded(tmp_path, monkeypatch):
    """A database named in the environment or the active profile is never shadowed by a copy, nor is
    one already in the home (or its journal, left without it)."""
    from lorapipe.flows.prefect_db import DATABASE_SETTINGS, DatabaseTemplate

    monkeypatch.chdir(tmp_path)
    home = Path("home")  # PREFECT_HOME may be relative
    home.mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for name in DATABASE_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    template = template_in(tmp_path / "xdg")
    template.parent.mkdir(parents=True)
    with closing(sqlite3.connect(template)) as db, db:
        db.execute("CREATE TABLE alembic_version (version_num)")
        db.execute("INSERT INTO alembic_version VALUES ('head')")
    url = "postgresql+asyncpg://prefect@db/prefect"
    assert DatabaseTemplate.for_new_home(home, {"PREFECT_API_DATABASE_CONNECTION_URL": url}) is None
    monkeypatch.setenv("PREFECT_SERVER_DATABASE_CONNECTION_URL", url)
    assert DatabaseTemplate.for_new_home(home, {}) is None
    monkeypatch.delenv("PREFECT_SERVER_DATABASE_CONNECTION_URL")
    (home / "prefect.db-wal").write_bytes(b"a journal left behind")
    assert DatabaseTemplate.for_new_home(home, {}) is None
    (home / "prefect.db-wal").unlink()
    assert DatabaseTemplate.for_new_home(home, {}).seed()
    assert rows(home / "prefect.db", "SELECT * FROM alembic_version") == [("head",)]
    assert DatabaseTemplate.for_new_home(home, {}) is None  # the home has its database now
    template.unlink()
    DatabaseTemplate(home / "prefect.db", template).save()
    assert rows(template, "SELECT * FROM alembic_version") == [("head",)]


def test_on_another_prefect_version_prefects_own_server_and_database_are_used(tmp_path, monkeypatch):
    """The early server and the database template copy Prefect's internals of one version: on any
    other, neither is used (no process launched, no home seeded) and Prefect starts its own server."""
    from lorapipe.flows import prefect_db
    from lorapipe.flows.server import EmbeddedServer

    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for name in ("PREFECT_API_URL", "PREFECT_PROFILE", "PREFECT_PROFILES_PATH", *prefect_db.DATABASE_SETTINGS):
        monkeypatch.delenv(name, raising=False)
    template_in(tmp_path / "xdg").parent.mkdir(parents=True)
    template_in(tmp_path / "xdg").write_bytes(b"a template")
    monkeypatch.setattr(prefect_db, "COPIED_FROM", "3.0.0", raising=False)
    assert prefect_db.DatabaseTemplate.for_new_home(tmp_path / "home", {}) is None
    server = EmbeddedServer.unless_configured()
    try:
        assert server.process is None and not (tmp_path / "home" / "prefect.db").exists()
        server.wait_ready()  # nothing to wait for: Prefect waits for its own
        assert server.connect() and "PREFECT_API_URL" not in os.environ
    finally:
        server.stop()


@pytest.fixture
def config(tmp_path, tiny_config):
    return tiny_config(tmp_path / "job", "template", max_steps=2)


@pytest.mark.slow
def test_a_new_home_starts_from_the_database_the_first_run_left(tmp_path, config):
    xdg_cache = tmp_path / "xdg"
    succeeds(start_run(config, tmp_path / "home-1", xdg_cache))
    template = template_in(xdg_cache)
    assert rows(template, "SELECT count(*) FROM alembic_version") == [(1,)]
    assert rows(template, "SELECT count(*) FROM flow_run") == [(0,)]  # saved before the run was written
    assert rows(template, "SELECT count(*) FROM log") == [(0,)]
    assert rows(tmp_path / "home-1" / "prefect.db", "SELECT count(*) FROM flow_run") == [(1,)]

    with closing(sqlite3.connect(template)) as db, db:
        db.execute("CREATE TABLE copied_from_the_template (marker)")  # empty: still a usable template
    succeeds(start_run(config, tmp_path / "home-2", xdg_cache))
    second = tmp_path / "home-2" / "prefect.db"
    assert rows(second, "SELECT name FROM sqlite_master WHERE name = 'copied_from_the_template'")
    assert rows(second, "SELECT count(*) FROM flow_run") == [(1,)]


@pytest.mark.slow
def test_a_damaged_template_is_replaced_and_two_runs_on_new_homes_at_once_succeed(tmp_path, config):
    xdg_cache = tmp_path / "xdg"
    template = template_in(xdg_cache)
    template.parent.mkdir(parents=True)
    template.write_bytes(b"not a database " * 1000)
    homes = [tmp_path / "home-a", tmp_path / "home-b"]
    succeeds(*[start_run(config, home, xdg_cache) for home in homes])
    for home in homes:
        assert rows(home / "prefect.db", "SELECT count(*) FROM flow_run") == [(1,)]
    assert rows(template, "SELECT count(*) FROM alembic_version") == [(1,)]  # a good one written in its place
    assert rows(template, "SELECT count(*) FROM flow_run") == [(0,)]
    assert not list(template.parent.glob(".prefect-db-*")) and not list(tmp_path.glob("home-*/.prefect-db-*"))
