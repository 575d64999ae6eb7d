"""Train: step time over the cached shards vs an on-the-fly baseline, the bare denoiser step, and
how much faster the shards are read than training consumes them.

All use the same tiny model (SD1.5; `train_step_flux1`: Flux.1 dev), LoRA, optimizer, batch and resolution, in this process
(the stage's recipe object, no accelerate launch, no Prefect):
- cached:     the recipe's own step (its loader threads read records by shard and offset, sample the
              posterior and noise; the step copies them to the device, runs the denoiser forward +
              backward and the optimizer step);
- cached inline: the same with train.loader_workers 0: the step prepares its own micro-batch;
- on the fly: what diffusers' train_text_to_image_lora.py does every step: decode, resize and crop
              the images, tokenize and run the text encoder(s), run the VAE encoder, then the same step;
- bare:       the denoiser forward + backward + optimizer step on one micro-batch already on the device;
- loader:     `load_batch` alone, in samples/s, as a multiple of what `cached` consumes;
- verify:     the digest check of every record a micro-batch reads (part of `cached` and `loader`),
              as a share of the cached step.
Each variant runs in rounds taken in turn and keeps its fastest round, on one torch thread: on a
shared 2-core machine a two-thread step slows down several-fold whenever a neighbour computes.
benchmarks/gpu_bench.py runs the same four steps at full size on a GPU.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from .common import Timing, generated_images, interleaved, tiny_model
from .encode_bench import encode_inputs, load_encoders, run_encode

if TYPE_CHECKING:
    import torch

    from lorapipe.stages.train.recipe import LoRATrainingRecipe

BATCH, IMAGES = 4, 64
TIMING = Timing(warmup=3, rounds=10, steps=10)


def training_recipe(enc_inputs, encoded_dir: Path, work: Path, batch_size: int = BATCH,
                    mixed_precision: str = "no", rank: int = 4, loader_workers: int = 2,
                    gradient_checkpointing: bool = False, base_quantization: str = "none",
                    prior_target: str = "data", blocks_to_swap: int | float | None = None) -> LoRATrainingRecipe:
    """The train stage's recipe, set up in this process over the encoded shards (LoRA alpha = rank)."""
    from lorapipe.stages.train import TrainInputs, TrainOptions, TrainParams
    from lorapipe.stages.train.recipe import LoRATrainingRecipe

    params = TrainParams(batch_size=batch_size, max_steps=10**6, learning_rate=1e-4, rank=rank, alpha=rank,
                         mixed_precision=mixed_precision, base_quantization=base_quantization,
                         prior_target=prior_target)
    inputs = TrainInputs(encoded_dir, enc_inputs.cache_root, enc_inputs.model_path, "bench", "bench")
    options = TrainOptions(log_with="none", loader_workers=loader_workers,
                           gradient_checkpointing=gradient_checkpointing, blocks_to_swap=blocks_to_swap)
    recipe = LoRATrainingRecipe(params, inputs, options, work)
    recipe.setup()
    recipe.experts[0].denoiser.train()
    recipe.batches = recipe.micro_batches()
    return recipe


def optimizer_step(recipe: LoRATrainingRecipe, loss: torch.Tensor) -> None:
    """What the recipe's step does with a micro-batch's loss."""
    acc = recipe.accelerator
    acc.backward(loss)
    acc.clip_grad_norm_(recipe.lora_params, recipe.params.max_grad_norm)
    recipe.optimizer.step()
    recipe.optimizer.zero_grad(set_to_none=True)


def cached_step(recipe: LoRATrainingRecipe) -> Callable[[int], None]:
    def step(i: int) -> None:
        recipe._train_step(recipe.experts[0])
        recipe.step += 1

    return step


def bare_step(recipe: LoRATrainingRecipe) -> Callable[[int], None]:
    """The recipe's denoiser step on its first micro-batch, prepared once and kept on the device."""
    from lorapipe.stages.train.recipe import step_loss

    device = recipe.accelerator.device
    inputs = recipe._prepare(0).map_tensors(lambda t: t.to(device))
    expert = recipe.experts[0]
    return lambda i: optimizer_step(recipe, step_loss(expert.family, expert.objective, expert.denoiser, inputs, device,
                                                      recipe.dtype))


def on_the_fly_step(recipe: LoRATrainingRecipe, enc_inputs) -> Callable[[int], None]:
    """A step that encodes its micro-batch from the image files first, as diffusers'
    train_text_to_image_lora.py does, in the training dtype (the family's VAE and text encoder(s)
    under autocast), then the recipe's step."""
    import torch

    from lorapipe.stages.encode import ImageCrops
    from lorapipe.stages.preprocess.rows import read_rows
    from lorapipe.stages.train.data import Batch, step_inputs
    from lorapipe.stages.train.recipe import step_loss

    device, dtype, expert = recipe.accelerator.device, recipe.dtype, recipe.experts[0]
    samples = read_rows(enc_inputs.preprocess_dir / "dataset.json")
    row = {s.id: i for i, s in enumerate(samples)}
    crops = ImageCrops(enc_inputs.datasets, samples, [False] * len(samples))
    encoders = load_encoders(enc_inputs, str(device), dtype)
    autocast = torch.autocast(device.type, dtype, enabled=dtype != torch.float32)

    def step(i: int) -> None:
        chosen = recipe.plan.batch(i, 0)
        rng = torch.Generator().manual_seed(i)
        pixels = torch.stack([crops[row[s.id]][1] for s in chosen])
        with torch.no_grad(), autocast:
            texts = encoders.text([s.caption for s in chosen])
            mean, std = encoders.vae(pixels)
        latents = recipe.data.normalisation.apply(mean.float() + std.float() * torch.randn(mean.shape, generator=rng))
        # drawn on the CPU, as the cached step's loader does
        batch = Batch(latents, texts, [(s, False) for s in chosen])
        inputs = step_inputs(expert.family, expert.objective, batch, rng, recipe.params)
        optimizer_step(recipe, step_loss(expert.family, expert.objective, expert.denoiser, inputs, device, dtype))

    return step


def step_calls(recipe: LoRATrainingRecipe, inline: LoRATrainingRecipe,
               enc_inputs) -> dict[str, Callable[[int], object]]:
    """The variants of the module docstring, called with a step number i (on the fly and the
    loader take micro-batch i; cached takes the recipe's next, bare always its first); `inline` is
    a second recipe with loader_workers 0."""
    import torch

    from lorapipe.stages.train.data import load_batch

    from .loader_bench import verification

    return {
        "cached": cached_step(recipe), "cached_inline": cached_step(inline), "bare": bare_step(recipe),
        "on_the_fly": on_the_fly_step(recipe, enc_inputs),
        "loader": lambda i: load_batch(recipe.data, recipe.plan.batch(i, 0), torch.Generator().manual_seed(i), 0.0),
        "verify": verification(recipe.data, recipe.plan),
    }


def step_figures(seconds: dict[str, float], batch: int) -> dict:
    """Milliseconds per step of each variant of `step_calls` and the ratios between them."""
    cached_s, fly_s, bare_s, load_s = (seconds[k] for k in ("cached", "on_the_fly", "bare", "loader"))
    return {
        "cached_step_ms": round(cached_s * 1e3, 2), "cached_it_s": round(1 / cached_s, 2),
        "bare_step_ms": round(bare_s * 1e3, 2), "cached_over_bare": round(cached_s / bare_s, 3),
        "cached_inline_step_ms": round(seconds["cached_inline"] * 1e3, 2),
        "inline_over_bare": round(seconds["cached_inline"] / bare_s, 3),
        "on_the_fly_step_ms": round(fly_s * 1e3, 2), "on_the_fly_over_cached": round(fly_s / cached_s, 2),
        "loader_samples_s": round(batch / load_s, 1), "training_consumes_samples_s": round(batch / cached_s, 1),
        "loader_over_consumption": round(cached_s / load_s, 1),
        "verify_ms": round(seconds["verify"] * 1e3, 4), "verify_share_of_cached_step": round(seconds["verify"] / cached_s, 5),
    }


def step_times(root: Path, arch: str = "sd15") -> dict:
    """The variants of the module docstring on the tiny model of `arch` (a registered tiny arch)."""
    import torch

    torch.set_num_threads(1)
    model = tiny_model(root, arch)
    data = generated_images(root / f"images-{IMAGES}", IMAGES)
    cache = root / f"train-bench-{arch}"
    shutil.rmtree(cache, ignore_errors=True)
    enc_inputs = encode_inputs(data, cache, model)
    run_encode(enc_inputs, cache / "encoded", workers=0)
    recipe = training_recipe(enc_inputs, cache / "encoded", cache / "work")
    inline = training_recipe(enc_inputs, cache / "encoded", cache / "work-inline", loader_workers=0)
    seconds = interleaved(step_calls(recipe, inline, enc_inputs), TIMING)
    recipe.batches.close()
    return {"model": f"tiny {arch}", "resolution": 64, "batch": BATCH, "steps": str(TIMING),
            "torch_threads": torch.get_num_threads(), **step_figures(seconds, BATCH)}


def optimizer_variants(root: Path) -> dict:
    """Milliseconds of the step's bookkeeping around the UNet on the tiny recipe's LoRA: AdamW as
    single-tensor loops (torch's CPU default), foreach or fused kernels, and gradient clipping
    over every UNet parameter vs over the LoRA's list."""
    import torch

    torch.set_num_threads(1)
    data = generated_images(root / f"images-{IMAGES}", IMAGES)
    cache = root / "optimizer-bench"
    shutil.rmtree(cache, ignore_errors=True)
    enc_inputs = encode_inputs(data, cache, tiny_model(root))
    run_encode(enc_inputs, cache / "encoded", workers=0)
    recipe = training_recipe(enc_inputs, cache / "encoded", cache / "work", loader_workers=0)
    unet = recipe._lora_denoiser(recipe.experts[0])
    lora = [t for t in unet.parameters() if t.requires_grad]
    for t in lora:
        t.grad = torch.randn_like(t)
    adamw = {kind: torch.optim.AdamW(lora, lr=1e-6, **{kind: True} if kind != "single_tensor" else {"foreach": False})
             for kind in ("single_tensor", "foreach", "fused")}
    seconds = interleaved({
        **{f"adamw_{kind}": lambda i, o=optimizer: o.step() for kind, optimizer in adamw.items()},
        "clip_over_unet_parameters": lambda i: torch.nn.utils.clip_grad_norm_(unet.parameters(), 1e9),
        "clip_over_lora_list": lambda i: torch.nn.utils.clip_grad_norm_(lora, 1e9),
    }, Timing(warmup=3, rounds=5, steps=20))
    return {"lora_tensors": len(lora), "lora_params": sum(t.numel() for t in lora),
            **{f"{name}_ms": round(s * 1e3, 3) for name, s in seconds.items()}}
