"""Independent trainings side by side. A training subprocess of the tiny models keeps about one core
busy (on CI's 2 cores it gets one torch thread) while the test's own process only waits on it, so on
2 idle cores two at a time take about the wall time of one. Only for trainings started through
`train.run` (a subprocess each): whole stages run in threads of one process (lorapipe.flows.runner) failed."""
from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

import pytest

AT_ONCE = 2
K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


def at_once(*calls: Callable[[], T]) -> list[T]:
    """The results of the zero-argument `calls`, run AT_ONCE at a time in threads, in their order;
    a failure is raised (the first in call order) once every call has ended."""
    with ThreadPoolExecutor(AT_ONCE) as pool:
        futures = [pool.submit(call) for call in calls]
    return [future.result() for future in futures]


@contextmanager
def started(calls: dict[K, Callable[[], T]]) -> Iterator[Callable[[K], T]]:
    """Start the zero-argument `calls` now, AT_ONCE at a time in their order; yields `result(key)`,
    which waits for that call's result (or raises its failure). On exit, calls not started are dropped
    and running ones waited for."""
    pool = ThreadPoolExecutor(AT_ONCE)
    try:
        futures = {key: pool.submit(call) for key, call in calls.items()}
        yield lambda key: futures[key].result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def selected(request: pytest.FixtureRequest, case_of: Callable[[pytest.Item], K | None]) -> list[K]:
    """The cases that this session's tests in the requesting module need, in run order and once each:
    `case_of(test item)`, None where an item needs none."""
    cases = (case_of(item) for item in request.session.items if item.module is request.module)
    return [case for case in dict.fromkeys(cases) if case is not None]


def case_by_test(tests: dict[str, Callable[[dict], K]]) -> Callable[[pytest.Item], K | None]:
    """`selected`'s case_of from test function names -> their case, given an item's parameters."""
    def case_of(item: pytest.Item) -> K | None:
        case = tests.get(item.originalname)
        return case(item.callspec.params if hasattr(item, "callspec") else {}) if case else None

    return case_of
