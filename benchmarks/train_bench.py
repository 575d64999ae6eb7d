"""Train: step time over the cached shards vs an on-the-fly baseline, the bare UNet step, and
how much faster the shards are read than training consumes them.

All four use the same tiny SD1.5 model, LoRA, optimizer, batch and resolution, in this process
(the stage's recipe object, no accelerate launch, no Prefect):
- cached:     the recipe's own step (read records by shard and offset, sample the posterior, UNet
              forward + backward, optimizer step);
- on the fly: what diffusers' train_text_to_image_lora.py does every step: decode, resize and crop
              the images, tokenize and run the text encoder, run the VAE encoder, then the same step;
- bare:       the UNet forward + backward + optimizer step on one batch already in memory;
- loader:     the recipe's batch loading alone, in samples/s, as a multiple of what `cached` consumes.
Each variant runs in rounds taken in turn and keeps its fastest round, on one torch thread: on a
shared 2-core machine a two-thread step slows down several-fold whenever a neighbour computes.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Callable

from .common import generated_images, tiny_model
from .encode_bench import _inputs, run_encode

BATCH, IMAGES, ROUNDS, STEPS, WARMUP = 4, 64, 5, 10, 3


def _interleaved(calls: dict[str, Callable[[int], None]]) -> dict[str, float]:
    """Seconds per call of each variant: rounds of STEPS calls taken in turn, the fastest round kept."""
    for call in calls.values():
        for i in range(WARMUP):
            call(i)
    best = {name: float("inf") for name in calls}
    for r in range(ROUNDS):
        for name, call in calls.items():
            started = time.perf_counter()
            for i in range(STEPS):
                call(WARMUP + r * STEPS + i)
            best[name] = min(best[name], (time.perf_counter() - started) / STEPS)
    return best


def _recipe(enc_inputs, encoded_dir: Path, work: Path):
    from stages.train import TrainInputs, TrainOptions, TrainParams
    from stages.train.recipe import LoRATrainingRecipe

    params = TrainParams(batch_size=BATCH, max_steps=10**6, learning_rate=1e-4)
    inputs = TrainInputs(encoded_dir, enc_inputs.cache_root, enc_inputs.model_path, "bench", "bench")
    recipe = LoRATrainingRecipe(params, inputs, TrainOptions(log_with="none"), work)
    recipe.setup()
    recipe.unet.train()
    recipe.batches = recipe.micro_batches()
    return recipe


def _optimizer_step(recipe, batch, rng) -> None:
    """The recipe's step on a given batch (what _train_step does after loading it)."""
    from stages.train.recipe import diffusion_loss

    acc = recipe.accelerator
    loss = diffusion_loss(recipe.unet, recipe.scheduler, batch, rng, recipe.params, acc.device, recipe.dtype)
    acc.backward(loss)
    acc.clip_grad_norm_(recipe.unet.parameters(), recipe.params.max_grad_norm)
    recipe.optimizer.step()
    recipe.optimizer.zero_grad(set_to_none=True)


def _on_the_fly(recipe, enc_inputs) -> Callable[[int], None]:
    """A step that encodes its batch from the image files first, as the diffusers example does."""
    import torch
    from diffusers import AutoencoderKL

    from stages.encode import ImageCrops, TextEncoder
    from stages.train.recipe import Batch

    samples = json.loads((enc_inputs.preprocess_dir / "dataset.json").read_text())["samples"]
    crops = ImageCrops(enc_inputs.datasets, samples, [False] * len(samples))
    vae = AutoencoderKL.from_pretrained(enc_inputs.model_path, subfolder="vae").eval().requires_grad_(False)
    text = TextEncoder(enc_inputs.model_path, "sd15", torch.float32)

    def step(i: int) -> None:
        rows = [(i * BATCH + j) % len(samples) for j in range(BATCH)]
        rng = torch.Generator().manual_seed(i)
        pixels = torch.stack([crops[r][1] for r in rows])
        with torch.no_grad():
            hidden = torch.stack([t["hidden_states"] for t in text([samples[r]["caption"] for r in rows])])
            latents = vae.encode(pixels).latent_dist.sample(rng) * vae.config.scaling_factor
        _optimizer_step(recipe, Batch(latents, hidden, None), rng)

    return step


def step_times(root: Path) -> dict:
    import torch

    from stages.train.recipe import load_batch

    torch.set_num_threads(1)
    model = tiny_model(root)
    data = generated_images(root / f"images-{IMAGES}", IMAGES)
    cache = root / "train-bench"
    shutil.rmtree(cache, ignore_errors=True)
    enc_inputs = _inputs(root, data, cache, model)
    run_encode(enc_inputs, cache / "encoded", workers=0)
    recipe = _recipe(enc_inputs, cache / "encoded", cache / "work")

    def cached(i: int) -> None:
        recipe._train_step()
        recipe.step += 1

    fixed = load_batch(recipe.data, recipe.plan.batch(0, 0), torch.Generator().manual_seed(0), 0.0)
    loads = lambda i: load_batch(recipe.data, recipe.plan.batch(i, 0), torch.Generator().manual_seed(i), 0.0)  # noqa: E731
    seconds = _interleaved({
        "cached": cached, "on_the_fly": _on_the_fly(recipe, enc_inputs), "loader": loads,
        "bare": lambda i: _optimizer_step(recipe, fixed, torch.Generator().manual_seed(i)),
    })
    cached_s, fly_s, bare_s, load_s = (seconds[k] for k in ("cached", "on_the_fly", "bare", "loader"))
    return {
        "model": "tiny sd15", "resolution": 64, "batch": BATCH, "steps": f"{ROUNDS}x{STEPS}, fastest round",
        "torch_threads": torch.get_num_threads(),
        "cached_step_ms": round(cached_s * 1e3, 2), "on_the_fly_step_ms": round(fly_s * 1e3, 2),
        "on_the_fly_over_cached": round(fly_s / cached_s, 2), "bare_unet_step_ms": round(bare_s * 1e3, 2),
        "loader_samples_s": round(BATCH / load_s, 1), "training_consumes_samples_s": round(BATCH / cached_s, 1),
        "loader_over_consumption": round(cached_s / load_s, 1),
    }
