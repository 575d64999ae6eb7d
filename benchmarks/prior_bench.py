"""The cost of train.prior_target base_output: the training step's time with the prior samples'
target taken from the frozen base model's prediction (one extra forward without the adapter, under
no_grad) over the step with their data target, as a ratio within one run.

One recipe of the train stage (stages/train/recipe.py, set up in this process, no accelerate
launch) over images that all come from a `role: prior` dataset, so every micro-batch is all prior
samples: the extra forward runs over the whole batch (the most it costs; a batch with fewer prior
samples runs it over those alone). The two variants are the same recipe, model and batches, its
base_output model switched off for the `data` calls, taken in turn by rounds on one torch thread.
64 px images, batch 4, LoRA rank 4 on attention, float32. The tiny SD1.5 and Flux.1 dev, and with
`--full-size` SD1.5 at its published size (random weights, built once under ROOT/models/sd15 as
benchmarks/common.py builds it).

    python -m benchmarks.prior_bench [--root DIR] [--full-size]
"""
from __future__ import annotations

import shutil
from pathlib import Path

from .common import Timing, full_size_cli, full_size_sd15, generated_images, interleaved, tiny_model
from .encode_bench import encode_inputs, run_encode
from .train_bench import cached_step, training_recipe

IMAGES = 16
TIMING = Timing(warmup=3, rounds=10, steps=10)
FULL_SIZE_TIMING = Timing(warmup=1, rounds=3, steps=1)  # seconds a step on a CPU


def step_ratio(root: Path, model: Path, name: str, timing: Timing) -> dict:
    import torch

    torch.set_num_threads(1)
    cache = root / f"prior-bench-{name}"
    shutil.rmtree(cache, ignore_errors=True)
    inputs = encode_inputs(generated_images(root / f"images-{IMAGES}", IMAGES), cache, model, role="prior")
    run_encode(inputs, cache / "encoded", workers=0)
    recipe = training_recipe(inputs, cache / "encoded", cache / "work", loader_workers=0, prior_target="base_output")
    base_model = recipe.experts[0].base_output_of
    step = cached_step(recipe)

    def with_target(model_or_none):
        def call(i: int) -> None:
            recipe.experts[0].base_output_of = model_or_none
            step(i)
        return call

    seconds = interleaved({"data": with_target(None), "base_output": with_target(base_model)}, timing)
    recipe.batches.close()
    return {"model": name, "resolution": 64, "batch": recipe.params.batch_size, "steps": str(timing),
            "torch_threads": torch.get_num_threads(), "data_step_ms": round(seconds["data"] * 1e3, 2),
            "base_output_step_ms": round(seconds["base_output"] * 1e3, 2),
            "base_output_over_data": round(seconds["base_output"] / seconds["data"], 3)}


def measure(root: Path, full_size: bool = False) -> dict:
    if full_size:
        return {"sd15_full_size": step_ratio(root, full_size_sd15(root), "SD1.5 at full size, random weights",
                                             FULL_SIZE_TIMING)}
    return {arch: step_ratio(root, tiny_model(root, arch), f"tiny {arch}", TIMING) for arch in ("sd15", "flux1")}


def main() -> None:
    full_size_cli("benchmarks.prior_bench", __doc__.split("\n\n")[0], "prior_base_output_step", measure)


if __name__ == "__main__":
    main()
