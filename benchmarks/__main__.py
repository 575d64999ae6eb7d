"""Run every benchmark and append the figures to BENCHMARKS.md.

    python -m benchmarks [--root DIR] [--only NAME]...     (make bench)

`gpu` (every full-size setting of benchmarks/gpu_bench.py) is skipped without a CUDA device; on
its own, with a line per measurement: python -m benchmarks.gpu_bench
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from . import (caption_bench, captioner_bench, clip_window_bench, cpu_matmul, decode_bench, encode_bench, gpu_bench, loader_bench, memory_bench,
               noop_rerun, object_bench, pipeline_noop, prior_bench, quant_memory_bench, sweep_bench, train_bench)
from .common import ResultsSection

BENCHES = {
    "noop_rerun": lambda root: noop_rerun.measure(root),
    "encode_throughput": lambda root: encode_bench.throughput(root),
    "encode_incremental": lambda root: encode_bench.incremental(root),
    "encode_dask_workers": lambda root: encode_bench.dask_workers(root),
    "stage_peak_memory": lambda root: memory_bench.stage_peaks(root),
    "quant_memory": lambda root: quant_memory_bench.measure(root),
    "loader_full_size": lambda root: loader_bench.throughput(root),
    "decode_camera_jpeg": lambda root: decode_bench.rates(root),
    "clip_windows": lambda root: clip_window_bench.measure(root),
    "train_step": lambda root: train_bench.step_times(root),
    "train_step_flux1": lambda root: train_bench.step_times(root, "flux1"),
    "optimizer_step": lambda root: train_bench.optimizer_variants(root),
    "prior_base_output_step": lambda root: prior_bench.measure(root),
    "pipeline_noop": lambda root: pipeline_noop.measure(root),
    "sweep_vs_separate_runs": lambda root: sweep_bench.measure(root),
    "object_noop": lambda root: object_bench.noop(root),
    "object_incremental": lambda root: object_bench.incremental(root),
    "object_shard_read": lambda root: object_bench.shard_read(root),
    "text_record_size": lambda root: caption_bench.record_sizes(root),
    "captioner_throughput": lambda root: captioner_bench.throughput(root),
    "captioner_noop": lambda root: captioner_bench.noop(root),
    "captioner_camera_reads": lambda root: captioner_bench.camera_reads(root),
    "cpu_matmul": cpu_matmul.measure,
    "gpu": lambda root: gpu_bench.measure(root),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, default=Path("bench-run"))
    parser.add_argument("--only", action="append", choices=sorted(BENCHES))
    args = parser.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    section = ResultsSection(" ".join(["python -m benchmarks", *(f"--only {o}" for o in args.only or [])]))
    for name in args.only or BENCHES:
        result = BENCHES[name](args.root.resolve())
        print(name, json.dumps(result))
        section.add(name, result)


if __name__ == "__main__":
    main()
