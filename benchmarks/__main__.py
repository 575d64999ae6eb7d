"""Run every CPU benchmark and append the figures to BENCHMARKS.md.

    python -m benchmarks [--root DIR] [--only NAME]...     (make bench)
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from . import encode_bench, noop_rerun, pipeline_noop, train_bench
from .common import machine

BENCHES = {
    "noop_rerun": lambda root: noop_rerun.measure(root),
    "encode_throughput": lambda root: encode_bench.throughput(root),
    "encode_incremental": lambda root: encode_bench.incremental(root),
    "encode_peak_memory": lambda root: encode_bench.peak_memory(root),
    "train_step": lambda root: train_bench.step_times(root),
    "pipeline_noop": lambda root: pipeline_noop.measure(root),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, default=Path("bench-run"))
    parser.add_argument("--only", action="append", choices=sorted(BENCHES))
    args = parser.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    lines = [f"\n### {time.strftime('%Y-%m-%d %H:%M')} — {machine()}", "",
             f"Command: `python -m benchmarks {' '.join('--only ' + o for o in args.only or [])}`".rstrip(), ""]
    for name in args.only or BENCHES:
        result = BENCHES[name](args.root.resolve())
        print(name, json.dumps(result))
        lines.append(f"- {name}: `{json.dumps(result)}`")
    with open(Path(__file__).resolve().parent.parent / "BENCHMARKS.md", "a") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
