"""Peak resident memory of each stage at two dataset sizes: it must not grow with the dataset
(and each stage's wall seconds, its process start included).

Each stage runs in a fresh process through the cache (flows.runner, no Prefect), the stages before
it served from the cache, so a process's peak is that stage's. Train does its work in an
accelerate child: train_child_mib is the largest of the launcher and its worker (getrusage, for
which a child's size starts at its parent's when forked); the stage's own process only waits.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

from .common import generated_images, tiny_model

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


def config(root: Path, images: Path, name: str) -> dict:
    return {
        "name": name, "cache_dir": str(root / "cache"), "output_dir": str(root / "out"),
        "model": {"path": str(tiny_model(root.parent))}, "data": {"path": str(images)},
        "preprocess": {"resolution": 64, "holdout_fraction": 0.01}, "encode": {"batch_size": 16},
        "train": {"max_steps": 20, "batch_size": 4, "checkpoint_every": 10, "log_with": "none"},
        "evaluate": {"prompts": ["a generated image"], "seeds": [0], "num_inference_steps": 2,
                     "loss_timesteps": [500]},
    }


def run_through(config_file: Path, last: str) -> None:
    """Serve or build every stage up to `last`."""
    from flows.config import load_config
    from flows.plan import STAGES, Context
    from flows.runner import run_stage

    ctx = Context(load_config(config_file), log=lambda m: None)
    upstream = {}
    for stage in STAGES[: STAGES.index(last) + 1]:
        _, upstream[stage] = run_stage(ctx, stage, upstream)
    ctx.close()


def stage_peaks(root: Path, sizes=(1000, 10000)) -> list[dict]:
    import yaml

    from flows.plan import STAGES

    rows = []
    for n in sizes:
        work = root / f"memory-{n}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        config_file = work / "config.yaml"
        config_file.write_text(yaml.safe_dump(config(work, generated_images(root / f"images-{n}", n), f"mem{n}")))
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
