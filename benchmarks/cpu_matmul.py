"""The three matrix products of a Linear layer's training step on this CPU, in float32 and bf16: why
the real-size rows (benchmarks/real_size.py) train in float32 where the weights fit.

    python -m benchmarks --only cpu_matmul

For x (tokens x width) through a square weight W (width x width, stored out x in as torch stores it):
the forward `x @ W.T`, the input gradient `g @ W` (W not transposed: the layout autograd's mm backward
hands the kernel) and the weight gradient `g.T @ x`, each in GFLOP/s on one thread and on all of them,
and each bf16 rate as a ratio of float32's in the same run.
"""
from __future__ import annotations

import os
import time

import torch

TOKENS, WIDTH = 256, 3072  # one 256 px image's tokens through a 3,072-wide transformer's projection
ROUNDS = 3


def _gflops(product, flops: float) -> float:
    product()  # warm-up: kernel selection, first-touch of the output
    started = time.perf_counter()
    for _ in range(ROUNDS):
        product()
    return round(flops * ROUNDS / (time.perf_counter() - started) / 1e9, 2)


def _rates(dtype: torch.dtype) -> dict[str, float]:
    generator = torch.Generator().manual_seed(0)
    x, g = (torch.randn(TOKENS, WIDTH, generator=generator).to(dtype) for _ in range(2))
    w = torch.randn(WIDTH, WIDTH, generator=generator).to(dtype)
    flops = 2 * TOKENS * WIDTH * WIDTH
    return {"forward x @ W.T": _gflops(lambda: torch.nn.functional.linear(x, w), flops),
            "input gradient g @ W": _gflops(lambda: g @ w, flops),
            "weight gradient g.T @ x": _gflops(lambda: g.t() @ x, flops)}


def measure(_root=None) -> dict:
    before = torch.get_num_threads()
    result = {"shape": f"{TOKENS}x{WIDTH} by {WIDTH}x{WIDTH}", "unit": "GFLOP/s"}
    try:
        for threads in sorted({1, os.cpu_count() or 1}):
            torch.set_num_threads(threads)
            rates = {str(dtype).removeprefix("torch."): _rates(dtype) for dtype in (torch.float32, torch.bfloat16)}
            rates["bf16 / float32"] = {name: round(rates["bfloat16"][name] / rates["float32"][name], 3)
                                       for name in rates["float32"]}
            result[f"{threads} thread(s)"] = rates
    finally:
        torch.set_num_threads(before)
    return result
