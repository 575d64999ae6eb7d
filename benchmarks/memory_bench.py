"""Peak resident memory of each stage at two dataset sizes: it must not grow with the dataset
(and each stage's wall seconds, its process start included).

Each stage runs in a fresh process through the cache (lorapipe.flows.runner, no Prefect), the stages before
it served from the cache, so a process's peak is that stage's. Train does its work in an
accelerate child: train_child_mib is the largest of the launcher and its worker (getrusage, for
which a child's size starts at its parent's when forked); the stage's own process only waits.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from .common import pipeline_config

REPO = Path(__file__).resolve().parent.parent
# VmHWM, not getrusage(RUSAGE_SELF): Linux carries ru_maxrss across fork and exec, so a stage
# process started by a big benchmark process would report that process's size
STAGE_PEAK = """
import re, resource, sys
from pathlib import Path
from benchmarks.memory_bench import run_through
run_through(Path(sys.argv[1]), sys.argv[2])
own = re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1)
print(own, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def run_through(config_file: Path, last: str) -> None:
    """Serve or build every stage up to `last`."""
    from lorapipe.flows.config import load_config
    from lorapipe.flows.steps import STAGES, Context
    from lorapipe.flows.runner import run_stage

    ctx = Context(load_config(config_file), log=lambda m: None)
    upstream = {}
    for stage in STAGES[: STAGES.index(last) + 1]:
        _, upstream[stage] = run_stage(ctx, stage, upstream)
    ctx.close()


def stage_peaks(root: Path, sizes=(1000, 10000)) -> list[dict]:
    from lorapipe.flows.steps import STAGES

    rows = []
    for n in sizes:
        train = {"max_steps": 20, "batch_size": 4, "checkpoint_every": 10, "log_with": "none"}
        config_file = pipeline_config(root, f"memory-{n}", n, train,
                                      evaluate={"prompts": ["a generated image"], "num_inference_steps": 2})
        row: dict = {"images": n}
        for stage in STAGES:
            started = time.perf_counter()
            out = subprocess.run([sys.executable, "-c", STAGE_PEAK, str(config_file), stage], cwd=REPO, check=True,
                                 capture_output=True, text=True).stdout.split()
            own, children = (round(int(kib) / 1024, 1) for kib in out[-2:])
            row[f"{stage}_mib"], row[f"{stage}_s"] = own, round(time.perf_counter() - started, 1)
            if stage == "train":
                row["train_child_mib"] = children
        rows.append(row)
    return rows
