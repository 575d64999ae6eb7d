"""How many torch CPU threads a stage's process runs: one rule for encode, train and evaluate,
wherever they run (the command's own process, the warm process, accelerate's workers, the workers
of the local Dask cluster encode starts: stages/processes/placement.py).

torch's CPU results depend on the thread count (the order of a float sum: a VAE latent, a LoRA
weight, a grid's pixel differ in their last bits), so the count depends on the config and the
machine only, never on how busy the machine is at the time: a rerun, a resume or another executor
on the same machine computes the same bytes. In order:

1. the stage's `cpu_threads` (encode, train or evaluate), else the config's top-level `cpu_threads`;
2. else OMP_NUM_THREADS in the run's environment (the shell of `lorapipe run`, a deployment's worker);
3. else the cores this process may run on (its CPU affinity: taskset, a container's cpuset; not
   os.cpu_count(), which counts the machine's) less one, left to the run's own process (Prefect,
   the log streams, encode's decode threads), shared among the stage's processes on this machine;
   at least one.

A count per process, as OMP_NUM_THREADS is. Leaving a core free also keeps a stage quick on a
busy machine: torch's threads wait for each other at every operation, so one that shares its core
with another program holds up the rest (BENCHMARKS.md, "Torch threads on a busy machine").
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from lorapipe.cache.errors import UserError

ENVIRONMENT = "OMP_NUM_THREADS"


def usable_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def threads_per_process(setting: int | None, processes: int = 1) -> int:
    """Torch threads for each of a stage's `processes` processes on this machine, given its
    `cpu_threads` setting (None: not set), by the rule above."""
    return setting or environment_threads() or max(1, (usable_cores() - 1) // processes)


def environment_threads() -> int | None:
    """OMP_NUM_THREADS as a number of threads (its first, for a nested list such as 4,2); None when unset."""
    value = os.environ.get(ENVIRONMENT, "").strip()
    if not value:
        return None
    first = value.split(",")[0].strip()
    if not first.isdigit() or int(first) == 0:
        raise UserError(f"{ENVIRONMENT}={value!r} in the environment is not a number of threads: set it to a whole"
                        " number such as 2, or unset it (the config's cpu_threads sets torch's threads too)")
    return int(first)


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's CPU threads set to `threads` for a job, and set back after it: the warm process
    (stages/processes/jobs.py) runs jobs that use different numbers."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
