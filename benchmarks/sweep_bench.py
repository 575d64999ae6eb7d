"""A sweep against separate runs: the wall time of `lorapipe sweep` over N learning rates, and of N
`lorapipe run`s, one per rate (`--set train.learning_rate=X`), one after the other, the way a user
sweeps without it. The tiny SD1.x model on the 8 bundled photos at 64 px; each side starts from
an empty cache of its own, so each encodes once (the separate runs: the first of them), and both
use one PREFECT_HOME made before the timing. Alternating rounds, the ratio taken within a round.

    python -m benchmarks.sweep_bench [--root DIR] [--variants N] [--steps S] [--rounds R]

Appends its figures to BENCHMARKS.md under the command (not with --smoke: one round of 2 variants
of 1 step, printed only).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from .common import ResultsSection, tiny_model

REPO = Path(__file__).resolve().parent.parent
DEMO_IMAGES = REPO / "stages" / "assets" / "demo_images"


def write_config(work: Path, model: Path, rates: list[float], steps: int) -> Path:
    """work/config.yaml: the demo job at `steps` steps, a sweep over `rates`, its cache and outputs in `work`."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    config = work / "config.yaml"
    config.write_text(yaml.safe_dump({
        "name": "bench", "cache_dir": "cache", "output_dir": "out", "model": {"path": str(model)},
        "data": {"path": str(DEMO_IMAGES)}, "preprocess": {"resolution": 64, "holdout_fraction": 0.25},
        "encode": {"num_workers": 0}, "train": {"max_steps": steps, "batch_size": 4, "checkpoint_every": steps},
        "evaluate": {"prompts": ["a photo of a cat"], "seeds": [0], "num_inference_steps": 2},
        "sweep": {"grid": {"train.learning_rate": rates}},
    }))
    return config


def timed(argv: list[str], env: dict) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "lorapipe.flows.cli", *argv], cwd=REPO, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def measure(root: Path, variants: int = 4, steps: int = 20, rounds: int = 1) -> dict:
    model = tiny_model(root)
    rates = [round(5e-4 * 2**i, 6) for i in range(variants)]
    env = {**os.environ, "PREFECT_HOME": str(root / "prefect-home"), "HF_HUB_OFFLINE": "1"}
    warm_up = write_config(root / "warm-up", model, rates, steps)
    timed(["run", str(warm_up), "--only", "preprocess"], env)  # Prefect's database, made once
    ratios, sweeps, separates = [], [], []
    for _ in range(rounds):
        sweep = timed(["sweep", str(write_config(root / "sweep", model, rates, steps))], env)
        config = write_config(root / "separate", model, rates, steps)
        separate = sum(timed(["run", str(config), "--set", f"train.learning_rate={rate}"], env) for rate in rates)
        sweeps.append(round(sweep, 1))
        separates.append(round(separate, 1))
        ratios.append(round(sweep / separate, 3))
    return {"variants": variants, "steps": steps, "sweep_s": sweeps, "separate_runs_s": separates,
            "sweep_over_separate": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sweep_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("bench-run"))
    parser.add_argument("--variants", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="2 variants of 1 step, one round; BENCHMARKS.md untouched")
    args = parser.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    shape = (2, 1, 1) if args.smoke else (args.variants, args.steps, args.rounds)
    result = measure(args.root.resolve(), *shape)
    print(json.dumps(result))
    if not args.smoke:
        given = f"--variants {args.variants} --steps {args.steps} --rounds {args.rounds}"
        ResultsSection(f"python -m benchmarks.sweep_bench {given}").add("sweep_vs_separate_runs", result)


if __name__ == "__main__":
    main()
