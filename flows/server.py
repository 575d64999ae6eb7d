"""Prefect's temporary server for a command that runs a flow without a configured API, started in
the command's first moments so that its start-up overlaps the command's own.

Prefect starts the same server itself (prefect.server.api.server.SubprocessASGIServer in 3.8.8)
when a flow first needs an API: after the command has imported prefect, and after importing the
whole server package into the command's process too, just to launch it. Here
the server process is launched before prefect is imported, with the command line and environment
Prefect gives its own, and PREFECT_API_URL then points Prefect at it. An API configured in the
environment or in the active Prefect profile is used as is (the server started here is stopped),
as is a profile that does not allow the temporary server.

On a PREFECT_HOME with no database yet, the server would create it and run every migration (slow):
the home gets a copy of an empty, migrated database kept per Prefect version
in the user's cache folder, and the first server that had to migrate leaves its database, once it
answers, as that copy (flows/prefect_db.py).

Both copy Prefect's internals as they are in one version (flows/prefect_db.py COPIED_FROM). On any
other version nothing is launched early: Prefect starts its own temporary server when the flow
first needs it, as it does for any script.

The server runs in its own session, so a Ctrl-C in the terminal reaches the command alone, which
can still record the interrupted run; it dies with the command (PR_SET_PDEATHSIG), and is stopped
at exit after Prefect's own exit handlers have sent their last logs and events.
"""
from __future__ import annotations

import atexit
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

from lorapipe.cache.errors import UserError, unusable_folder
from lorapipe.stages.processes.launching import free_port, start_child

from .prefect_db import DatabaseTemplate, copied_prefect

START_ATTEMPTS = 3  # uvicorn exits with 3 when it cannot start, e.g. when another process took the port
SERVER_ENV = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}


class EmbeddedServer:
    """A Prefect API server process on 127.0.0.1 at a free port, for this command only (or, on
    another Prefect version, none: Prefect's own, which Prefect starts)."""

    def __init__(self, unsaved_template: DatabaseTemplate | None = None, launch: bool = True) -> None:
        """launch=False: Prefect's own temporary server, started by Prefect when the flow needs it."""
        self.output = tempfile.TemporaryFile()  # shown only if the server fails to start
        self.attempts = 0
        self.process: subprocess.Popen | None = None
        self.unsaved_template = unsaved_template  # saved from the home's database once the server answers
        if launch:
            self._launch()
            atexit.register(self.stop)  # registered before prefect's: runs after theirs

    @classmethod
    def unless_configured(cls) -> EmbeddedServer | None:
        """A server started now, on a new home from the database template when there is one, or
        None when PREFECT_API_URL is set in the environment or in the active profile (a server kept
        running: docs/service.md, "Fast repeated runs")."""
        profile = active_profile()
        if os.environ.get("PREFECT_API_URL") or profile.get("PREFECT_API_URL"):
            return None
        home = make_prefect_home()
        if not copied_prefect():
            return cls(launch=False)
        template = DatabaseTemplate.for_new_home(home, profile)
        return cls(template if template and not template.seed() else None)

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def _launch(self) -> None:
        self.attempts += 1
        self.port = free_port()
        site = Path(importlib.util.find_spec("prefect").origin).parent.parent
        command = [sys.executable, "-m", "uvicorn", "--app-dir", str(site), "--factory",
                   "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(self.port),
                   "--log-level", "error", "--lifespan", "on"]
        self.process = start_child(command, env={**os.environ, **SERVER_ENV}, stdin=subprocess.DEVNULL,
                                   stdout=self.output, stderr=subprocess.STDOUT, start_new_session=True)

    def connect(self) -> bool:
        """Point Prefect at this server, unless the active profile names an API or does not allow a
        temporary server: then stop it. Returns whether the flow will use it."""
        from prefect.context import refresh_global_settings_context
        from prefect.settings import get_current_settings

        settings = get_current_settings()
        if self.process is not None and settings.api.url == self.api_url:  # an earlier run of the command connected it
            return True
        if settings.api.url or not settings.server.ephemeral.enabled:
            self.stop()
            return False
        if self.process is None:  # not launched here: Prefect launches its own
            return True
        os.environ["PREFECT_API_URL"] = self.api_url
        refresh_global_settings_context()
        return True

    def wait_ready(self) -> None:
        """Block until the server answers its health check (relaunched on another port if it could
        not start, up to START_ATTEMPTS times); at once for Prefect's own, which Prefect waits for."""
        if self.process is None:
            return
        deadline = time.monotonic() + float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", 90))
        while not self._healthy():
            if self.process.poll() is not None:
                if self.attempts >= START_ATTEMPTS:
                    raise RuntimeError(f"Prefect's temporary server did not start (exit code"
                                       f" {self.process.returncode}): {self._output_tail()}")
                self._launch()
                self.connect()
            if time.monotonic() > deadline:
                raise RuntimeError(f"Prefect's temporary server did not answer within the start-up timeout"
                                   f" (PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS): {self._output_tail()}")
            time.sleep(0.05)
        if self.unsaved_template:
            self.unsaved_template.save()  # before the flow writes its run
            self.unsaved_template = None

    def _healthy(self) -> bool:
        return api_answers(self.api_url)

    def _output_tail(self) -> str:
        self.output.seek(0)
        lines = self.output.read().decode(errors="replace").strip().splitlines()
        return " | ".join(lines[-5:]) or "it printed nothing"

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def api_answers(api_url: str) -> bool:
    """Whether the Prefect API at `api_url` answers its health check."""
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def active_profile() -> dict:
    """The settings of the active Prefect profile, read from the profiles file without importing
    prefect (which would delay the server this module starts early). Only an optimisation:
    connect() asks Prefect's own settings, and stops the early server for any other API source."""
    path = Path(os.environ.get("PREFECT_PROFILES_PATH", prefect_home() / "profiles.toml")).expanduser()
    try:
        profiles = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return {}  # no profiles file, or one Prefect will name in its own error
    active = os.environ.get("PREFECT_PROFILE") or profiles.get("active")
    profile = profiles.get("profiles", {}).get(active, {})
    return profile if isinstance(profile, dict) else {}


def prefect_home() -> Path:
    return Path(os.environ.get("PREFECT_HOME") or "~/.prefect").expanduser()


def make_prefect_home() -> Path:
    """PREFECT_HOME, created with its parents: the server's database lives there. Prefect creates
    only the last folder, so a home inside a folder not made yet (the demo's fresh workdir, made by
    the command only after the server starts) failed the server with 'unable to open database file'."""
    folder = prefect_home()
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(unusable_folder("PREFECT_HOME", folder, error)) from error
    return folder
