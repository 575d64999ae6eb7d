"""Independent trainings side by side. A training subprocess of the tiny models keeps about one core
busy (on CI's 2 cores it gets one torch thread) while the test's own process only waits on it, so on
2 idle cores two at a time take about the wall time of one. Only for trainings started through
`train.run` (a subprocess each): whole stages run in threads of one process (lorapipe.flows.runner) failed.
Many trainings of one module go to warm processes (`warm_trainers`), as `lorapipe run` hands its
training to the process it started ahead: torch, diffusers and peft imported once per process, not
once per training."""
from __future__ import annotations

import queue
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from functools import partial
from typing import TYPE_CHECKING, TypeVar

import pytest

if TYPE_CHECKING:
    from lorapipe.stages.processes.placement import Placement

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


@contextmanager
def trained_ahead(cpu_threads: int | None = None) -> Iterator[Placement]:
    """Where `train.run(..., placement=)` (or a Context's "train") trains in one process started ahead,
    as `lorapipe run` starts one: it trains as a process of its own would (tests/test_train.py, a
    process started ahead), one training after another, importing torch, diffusers and peft once.
    It hides what a training with default libraries hides: a training that uses one of those, or
    one after a failed job (which ends the process), runs in a process of its own."""
    from lorapipe.stages import train
    from lorapipe.stages.processes.placement import OwnProcess, WarmProcess, place

    params, options = train.TrainParams(), train.TrainOptions(cpu_threads=cpu_threads)
    with WarmProcess(OwnProcess().threads(options.cpu_threads), train.unused_libraries(params)) as process:
        yield place(train.where(params, options), process)


@contextmanager
def warm_trainers(cpu_threads: int | None = 1) -> Iterator[Callable[[Callable[[Placement], T]], T]]:
    """AT_ONCE `trained_ahead` placements; yields `in_warm(call)`, which takes an idle one and
    returns call(it)."""
    with ExitStack() as stack:
        idle: queue.SimpleQueue[Placement] = queue.SimpleQueue()
        for _ in range(AT_ONCE):
            idle.put(stack.enter_context(trained_ahead(cpu_threads)))

        def in_warm(call: Callable[[Placement], T]) -> T:
            placement = idle.get()
            try:
                return call(placement)
            finally:
                idle.put(placement)

        yield in_warm


@contextmanager
def started_warm(trainings: dict[K, Callable[[Placement], T]]) -> Iterator[Callable[[K], T]]:
    """`started` for trainings that take their placement: each runs in one of `warm_trainers`'."""
    with warm_trainers() as in_warm, started({key: partial(in_warm, run) for key, run in trainings.items()}) as result:
        yield result


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
