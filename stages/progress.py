"""Progress lines as tqdm draws its bar: count, bar, percent, elapsed < ETA, rate.

One line per update instead of a bar redrawn in place: the lines reach the user through a pipe,
the run's log file and the Prefect log, where each redraw would become a line of its own (and a
carriage return garbles a log file). The caller decides how often to print one.
"""
from __future__ import annotations

from tqdm import tqdm

BAR_FORMAT = "{desc} |{bar:20}| {percentage:3.0f}% [{elapsed}<{remaining}, {rate_fmt}]"


def progress_line(what: str, done: int, total: int, elapsed: float, since: int = 0, unit: str = "it",
                  note: str = "") -> str:
    """`what done/total note |####  | 37% [00:05<00:09, 13.2it/s]`; the rate and ETA count only
    the `done - since` units of this run (a resumed run starts at `since`)."""
    return tqdm.format_meter(done, total, elapsed, prefix=f"{what} {done}/{total}{note}", unit=unit, initial=since,
                             ascii=True, bar_format=BAR_FORMAT)
