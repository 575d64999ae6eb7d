"""An empty, migrated Prefect database kept per Prefect version, so that the temporary server
(flows/server.py) starts on a new PREFECT_HOME without creating its database and running every
alembic migration (most of its start-up: BENCHMARKS.md).

The template is `lorapipe/prefect-VERSION-sqlite.db` in the user's cache folder (XDG_CACHE_HOME,
else ~/.cache). A server starting on a home with no database gets a copy of it; a server that had to
migrate a new home itself (no template yet) leaves its database, snapshot once it answers and before
any run is written, as the template. Only Prefect's default database (PREFECT_HOME/prefect.db) is
seeded: none when the environment or the active profile names another one. A database named only
in a `.env` or `prefect.toml` leaves an unused copy in the home, no worse.

It only saves start-up time: any failure (an unwritable folder, a damaged template, another command
seeding the same home) leaves the server to migrate as without it, and deleting it is always safe.
Like flows/server.py it relies on Prefect's internals as they are in one version (COPIED_FROM): on
any other, no home is seeded and Prefect's server creates its database itself.
"""
from __future__ import annotations

import importlib.metadata
import os
import shutil
import sqlite3
import tempfile
from contextlib import closing
from pathlib import Path

from lorapipe.cache.fsutil import user_cache_dir

COPIED_FROM = "3.8.8"  # the Prefect whose server start (flows/server.py) and database tables this copies
# Prefect settings that put the server's database somewhere other than PREFECT_HOME/prefect.db
DATABASE_SETTINGS = tuple(f"PREFECT_{scope}_DATABASE_{name}" for scope in ("SERVER", "API")
                          for name in ("CONNECTION_URL", "DRIVER", "NAME"))
# the tables a server's start fills; every other one holds what runs, deployments or users wrote
STARTUP_TABLES = frozenset({"alembic_version", "block_type", "block_schema", "block_schema_reference"})


class DatabaseTemplate:
    """The template for `database`, a home's default database that does not exist yet."""

    def __init__(self, database: Path, template: Path) -> None:
        self.database, self.template = database, template

    @classmethod
    def for_new_home(cls, home: Path, profile: dict) -> DatabaseTemplate | None:
        """None unless the server will create Prefect's default database in `home` (a stale journal
        there without its database counts as a database: it must not meet a copy)."""
        if any(os.environ.get(name) or profile.get(name) for name in DATABASE_SETTINGS):
            return None
        database = home / "prefect.db"
        if any(Path(f"{database}{end}").exists() for end in ("", "-wal", "-journal")):
            return None
        if not copied_prefect():
            return None
        try:
            return cls(database, user_cache_dir() / f"prefect-{COPIED_FROM}-sqlite.db")
        except RuntimeError:  # no home folder
            return None

    def seed(self) -> bool:
        """Copy the template in as the home's database; whether it was. A template that is not an
        empty, migrated database is removed (the next new home's server writes a good one)."""
        if not self.template.is_file():
            return False
        copy = None
        try:
            copy = temporary_file(self.database.parent)
            shutil.copyfile(self.template, copy)
            if not is_empty_migrated(copy):
                self.template.unlink(missing_ok=True)
                return False
            os.link(copy, self.database)  # unlike a rename, never replaces a database another command's server made
            return True
        except OSError:
            return False
        finally:
            if copy:
                copy.unlink(missing_ok=True)

    def save(self) -> None:
        """Snapshot the home's database (open in the server, in WAL mode) as the template, if none
        exists and it holds only what the server's start wrote."""
        if self.template.exists():
            return
        copy = None
        try:
            self.template.parent.mkdir(parents=True, exist_ok=True)
            copy = temporary_file(self.template.parent)
            with closing(read_only(self.database)) as source, closing(sqlite3.connect(copy)) as target:
                source.backup(target)  # one read transaction: consistent while the server writes
                target.execute("PRAGMA journal_mode=DELETE")  # one self-contained file
            if is_empty_migrated(copy):
                os.replace(copy, self.template)
        except (OSError, sqlite3.Error):
            pass
        finally:
            if copy:
                copy.unlink(missing_ok=True)


def copied_prefect() -> bool:
    """Whether the installed Prefect is the version whose internals this module and flows/server.py
    copy (read from its metadata: importing prefect would delay the server's launch)."""
    try:
        return importlib.metadata.version("prefect") == COPIED_FROM
    except importlib.metadata.PackageNotFoundError:
        return False


def temporary_file(folder: Path) -> Path:
    descriptor, path = tempfile.mkstemp(dir=folder, prefix=".prefect-db-", suffix=".tmp")
    os.close(descriptor)
    return Path(path)


def read_only(path: Path) -> sqlite3.Connection:
    """A connection that never creates `path` (a server using another database left none)."""
    return sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True)


def is_empty_migrated(path: Path) -> bool:
    """Whether `path` is an intact SQLite database with an alembic revision and no rows outside
    what a Prefect server's start writes (no flows, runs, logs or events)."""
    try:
        with closing(read_only(path)) as db:
            if db.execute("PRAGMA quick_check").fetchone() != ("ok",):
                return False
            if not db.execute("SELECT version_num FROM alembic_version").fetchone():
                return False
            tables = [name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'"
                                                       " AND name NOT LIKE 'sqlite%'")]
            return not any(db.execute(f'SELECT 1 FROM "{name}" LIMIT 1').fetchone()
                           for name in tables if name not in STARTUP_TABLES)
    except sqlite3.Error:
        return False
