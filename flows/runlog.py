"""The run's log file, and a terminal that ends a failed run with one line.

Every `lorapipe run` writes what Prefect and the stages log, tracebacks included (a training
process's too), to `OUTPUT_DIR/logs/run-<time>-<pid>.log`. The terminal gets the same lines minus
the tracebacks and minus Prefect's reports of the failure (it logs one error up to six times: the
task's failure with its traceback, the task's final state, the flow's exception with the traceback
again, the flow's final state); the command's last line says what went wrong. `--debug` keeps the
terminal unfiltered.
"""
from __future__ import annotations

import logging
import os
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")
FAILED_STATE = re.compile(r"Finished in state (Failed|Crashed)")
FILE_FORMATS = {  # Prefect's console formats with the date
    "format": "%(asctime)s | %(levelname)-7s | %(name)s - %(message)s",
    "flow_run_fmt": "%(asctime)s | %(levelname)-7s | Flow run %(flow_run_name)r - %(message)s",
    "task_run_fmt": "%(asctime)s | %(levelname)-7s | Task run %(task_run_name)r - %(message)s",
}


class TerminalFilter(logging.Filter):
    """Keeps tracebacks, detail lines (lorapipe.detail) and Prefect's failure reports off the
    terminal; once `closed`, also Prefect's shutdown notes (its temporary server stops at exit),
    so that a failed command's last line stays the error."""

    closed = False

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info or record.name.startswith("lorapipe."):
            return False
        if record.name.startswith(RUN_LOGGERS):
            return record.levelno < logging.ERROR and not FAILED_STATE.match(record.getMessage())
        return not self.closed or record.levelno >= logging.WARNING


def new_log_path(output_dir: Path) -> Path:
    """This command's log file: `output_dir/logs/run-<time>-<pid>.log`."""
    return Path(output_dir) / "logs" / f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"


@contextmanager
def run_log(path: Path, debug: bool = False, flow: bool = True) -> Iterator[Path]:
    """Log everything to the file `path` (appended to) while the run lasts; on an exception, write
    its traceback there and say on stderr where the file is. flow=False: no Prefect in this process
    (a run served wholly from the cache), so neither its formats nor its console are involved."""
    path.parent.mkdir(parents=True, exist_ok=True)
    file_handler = logging.FileHandler(path, encoding="utf-8")
    root, detail = logging.getLogger(), logging.getLogger("lorapipe")
    if flow:
        from prefect.logging.formatters import PrefectFormatter
        from prefect.logging.handlers import PrefectConsoleHandler

        file_handler.setFormatter(PrefectFormatter(**FILE_FORMATS))
        consoles = [] if debug else [h for h in root.handlers if isinstance(h, PrefectConsoleHandler)]
    else:
        file_handler.setFormatter(logging.Formatter(FILE_FORMATS["format"]))
        consoles = []
    terminal, detail_level = TerminalFilter(), detail.level
    root.addHandler(file_handler)
    detail.setLevel(logging.INFO)
    for console in consoles:
        console.addFilter(terminal)
    try:
        yield path
    except BaseException as error:
        interrupted = isinstance(error, KeyboardInterrupt)
        file_handler.handle(logging.LogRecord("lorapipe", logging.ERROR, __file__, 0,
                                              "the run was interrupted" if interrupted else "the run failed", None,
                                              sys.exc_info()))
        if not interrupted:  # Ctrl-C: the user knows why, and the command says what was kept
            print(f"lorapipe: the full log of this run: {path}", file=sys.stderr)
        terminal.closed = True  # stays on the console until the process exits
        consoles = []
        raise
    finally:
        for console in consoles:
            console.removeFilter(terminal)
        detail.setLevel(detail_level)
        root.removeHandler(file_handler)
        file_handler.close()
