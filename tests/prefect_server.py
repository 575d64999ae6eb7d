"""One kept Prefect server per test session (per pytest-xdist worker), for the modules whose commands
run flows many times over and test something other than how a command gets its server.

Without PREFECT_API_URL every `lorapipe run`, `sweep` or `demo` starts Prefect's temporary server,
about 6 CPU-seconds of its own imports and start-up on these machines (docs/testing.md); a command
pointed at a kept server runs its flow there, as a user's command under a deployment or with an
API configured does (flows/server.py). The temporary server stays what tests/test_demo*.py,
tests/test_prefect_db.py, tests/test_cli.py and `make demo` run on, and what a module runs on whose
checks differ with a configured API: a run whose every stage is cached is served without a flow only
where it would have had to start a temporary server (flows/cached_run.py; tests/test_object_pipeline.py).
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from browser import stop

from lorapipe.flows.server import api_answers
from lorapipe.stages.processes.launching import free_port

PREFECT = str(Path(sys.executable).with_name("prefect"))
START_TIMEOUT = 120  # seconds: its first start migrates a new database


@contextmanager
def kept_server(home: Path, env: dict[str, str]) -> Iterator[str]:
    """`prefect server start` on a free port of 127.0.0.1, its database in HOME, without its UI or
    background services (nothing here schedules runs): its API URL while it answers; stopped after."""
    port = free_port()
    home.mkdir(parents=True, exist_ok=True)
    log = open(home / "server.log", "w")
    server = subprocess.Popen(
        [PREFECT, "server", "start", "--no-services", "--no-ui", "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env={**env, "PREFECT_HOME": str(home)})
    try:
        api = f"http://127.0.0.1:{port}/api"
        deadline = time.time() + START_TIMEOUT
        while not api_answers(api):
            if server.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the kept Prefect server did not start: {(home / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield api
    finally:
        stop(server, signal.SIGTERM)
        log.close()

