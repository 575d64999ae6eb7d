"""The processes a sweep's variants train and evaluate in: one started ahead per concurrency slot
(a WarmProcess, as `lorapipe run` starts one), each taking one variant after another, so that torch,
diffusers, peft and accelerate are imported once per slot rather than once per variant."""
from __future__ import annotations

import queue
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from lorapipe.stages.processes.placement import WarmProcess

from ..config import PipelineConfig
from ..run_plan import select


class WarmSlots:
    """Idle warm processes; a variant takes one for its stages and hands it back when done."""

    def __init__(self, processes: tuple[WarmProcess, ...] = ()):
        self.idle: queue.SimpleQueue[WarmProcess] = queue.SimpleQueue()
        for process in processes:
            self.idle.put(process)

    @contextmanager
    def taken(self) -> Iterator[WarmProcess | None]:
        """An idle warm process, or None when none is (none was started: its stages run where their
        settings alone say)."""
        try:
            process = self.idle.get_nowait()
        except queue.Empty:
            yield None
            return
        try:
            yield process
        finally:
            self.idle.put(process)


@contextmanager
def started_slots(base: PipelineConfig, count: int) -> Iterator[WarmSlots]:
    """`count` warm processes for trainings of `base` (fewer when its training does not run in one
    process of its own: none), ended when the sweep is."""
    with ExitStack() as stack:
        plan = select(base, [], None, [])
        processes = [plan.warm_process(base) for _ in range(count)]
        yield WarmSlots(tuple(stack.enter_context(p) for p in processes if p is not None))
