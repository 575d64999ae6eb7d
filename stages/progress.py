"""Progress lines as tqdm draws its bar: count, bar, percent, elapsed < ETA, rate.

One line per update instead of a bar redrawn in place: the lines reach the user through a pipe,
the run's log file and the Prefect log, where each redraw would become a line of its own (and a
carriage return garbles a log file). The caller decides how often to print one.
"""
from __future__ import annotations

import time

from tqdm import tqdm

from .contract import Log

BAR_FORMAT = "{desc} |{bar:20}| {percentage:3.0f}% [{elapsed}<{remaining}, {rate_fmt}]"


def progress_line(what: str, done: int, total: int, elapsed: float, since: int = 0, unit: str = "it",
                  note: str = "") -> str:
    """`what done/total note |####  | 37% [00:05<00:09, 13.2it/s]`; the rate and ETA count only
    the `done - since` units of this run (a resumed run starts at `since`)."""
    return tqdm.format_meter(done, total, elapsed, prefix=f"{what} {done}/{total}{note}", unit=unit, initial=since,
                             ascii=True, bar_format=BAR_FORMAT)


class ProgressLines:
    """progress_line()s of `what` through `log`: at most every `every` seconds, and at the end. With
    `from_start` the first comes at the first update; without it only after `every` seconds, so a
    job that ends sooner prints none. `tail` follows each line."""

    def __init__(self, what: str, total: int, log: Log, every: float, unit: str = "it", note: str = "",
                 tail: str = "", from_start: bool = True):
        self.what, self.total, self.log, self.every = what, total, log, every
        self.unit, self.note, self.tail = unit, note, tail
        self.done, self.started, self.shown = 0, time.perf_counter(), False
        self.last = float("-inf") if from_start else self.started

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if now - self.last < self.every and not (self.shown and self.done >= self.total):
            return
        self.last, self.shown = now, True
        line = progress_line(self.what, self.done, self.total, now - self.started, unit=self.unit, note=self.note)
        self.log(line + self.tail)
