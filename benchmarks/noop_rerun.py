"""How long does deciding "nothing to do" take on an unchanged folder, and how does it grow?

For N images: time `lorapipe status` logic (preprocess fingerprint with the stat cache, then every
stage's key and lookup) on a cold stat cache, then warm. The warm figure is what a scheduled no-op
rerun pays beyond Python and Prefect start-up.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

from .common import generated_images, tiny_model


def decide(config) -> float:
    from lorapipe.flows.steps import Context, config_stages
    from lorapipe.flows.runner import explain

    started = time.perf_counter()
    ctx = Context(config, log=lambda m: None)
    explain(ctx, config_stages(config))
    ctx.close()
    return time.perf_counter() - started


def run_preprocess(config) -> None:
    from lorapipe.flows.steps import Context
    from lorapipe.flows.runner import run_stage

    ctx = Context(config, log=lambda m: None)
    run_stage(ctx, "preprocess", {})
    ctx.close()


def measure(root: Path, sizes=(1000, 10000)) -> list[dict]:
    from lorapipe.flows.config import validate_config

    model = tiny_model(root)
    rows = []
    for n in sizes:
        data = generated_images(root / f"images-{n}", n)
        cache = root / f"noop-cache-{n}"
        shutil.rmtree(cache, ignore_errors=True)
        config = validate_config({
            "name": f"noop{n}", "cache_dir": cache, "output_dir": root / "out", "model": {"path": model},
            "data": {"path": data}, "preprocess": {"resolution": 64}, "train": {"max_steps": 1},
            "evaluate": {"prompts": ["x"]}}, "benchmark")
        run_preprocess(config)
        (cache / "stat-cache.sqlite").unlink()
        cold, warm = decide(config), decide(config)
        rows.append({"images": n, "cold_s": round(cold, 3), "warm_s": round(warm, 3),
                     "warm_us_per_image": round(warm / n * 1e6, 1)})
    return rows
