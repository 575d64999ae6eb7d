"""GPU: encode and train at full size on one GPU, mixed precision bf16 as the train stage runs it
(frozen denoiser in bf16, LoRA rank 16 on the family's default preset in fp32), each setting in this
process (no accelerate launch; nothing from flows/, so no Prefect). Settings (`--only NAME`):

    sd15                    SD1.5 at 512 px, batch 8
    sdxl                    SDXL at 1024 px, batch 4
    flux1                   Flux.1-dev at 1024 px, batch 1, gradient checkpointing on
    flux1-no-checkpointing  the same, gradient checkpointing off (same model folder and images)
    flux1-int8, -fp8, -nf4  flux1 with train.base_quantization int8, fp8, nf4 (issue 16's goal: under
                            24 GB peak at >= 0.7x flux1's it/s)
    flux2-klein             Flux.2-klein base 4B at 1024 px, batch 1
    flux2-klein-9b          Flux.2-klein base 9B at 1024 px, batch 1, gradient checkpointing on,
      -int8, -fp8, -nf4     and with each base_quantization
      -swap                 and with train.blocks_to_swap 0.5 (half its blocks' frozen weights on the host)
    wan2.1-14b              Wan 2.1 T2V 14B on clips of 81 frames at 832x448 (480p with sides of 64s),
      -swap                 batch 1, gradient checkpointing on; and with all 40 blocks swapped. Without
                            swap it needs more than an H100's 80 GB (the inline recipe holds a second
                            denoiser, the on-the-fly step the text encoder): run it on an H200
    z-image                 Z-Image (base) at 1024 px, batch 1

Nothing here knows a family: every setting names an architecture folder, and its model, encoders,
step and LoRA come through the family layer (stages/families) as the stages get them.

1. model:  random weights from the published architecture configs in stages/assets/arch/<arch>/
           (full-size text encoders included: CLIP, T5-XXL, Qwen3-4B, Qwen3-8B) with the tokenizers of the
           family's tiny model (built offline; checked to fit the text encoders' vocabularies),
           initialised on the GPU in bf16 from a fixed seed and saved under ROOT/models/<arch>
           (reused after; about 2, 7, 34, 16, 35, 20 and 40 GB for sd15, sdxl, flux1, flux2-klein,
           flux2-klein-9b, z-image and wan2.1-14b). Clip settings encode generated mp4 clips.
2. encode: N generated noise images through the real encode stage (records in bf16) vs the bare
           latent + text encoders' forward on the same pre-decoded batches, both loaded as the stage
           loads them; ratio = bare / stage time (goal >= 0.9), also without the encoders' load time.
3. train steps, train_bench's variants in interleaved rounds (fastest round kept, the GPU
           synchronised around each round): cached (the recipe's own step over the encoded shards;
           cached inline: with train.loader_workers 0, the micro-batch prepared in the step),
           bare (denoiser forward + backward + optimizer on a micro-batch already on the GPU), on the
           fly (VAE + text encoder(s) every step, then the same step) and the loader (`load_batch`
           alone). Goals: cached within 5% of bare; the loader >= 10x the samples/s the step consumes.
4. cached step variants: sdpa (the denoiser's own attention processors: diffusers' scaled-dot-product
           ones), classic (diffusers' AttnProcessor, for the UNets), sdpa + torch.compile(denoiser).
           Each reports its peak GPU memory and MFU: the FLOPs one forward + backward executes
           (torch.utils.flop_counter; about 1.8x the forward, as the frozen weights get no gradients;
           with gradient checkpointing the recomputed forward too) / step time / the GPU's dense bf16
           peak (null for a GPU not in PEAK_BF16_FLOPS). first_step_s is the variant's first step
           alone: for a compiled variant its compilation, which is not in its step time. A variant
           that fails (compile error, out of memory) reports its error and the run goes on; so does a
           setting that fails (as "<setting> error", e.g. the on-the-fly step's encoders beside an
           uncheckpointed transformer running out of memory): the next settings still run.
           sdpa+offload (last, as it stays applied): diffusers' group offloading of the denoiser
           (block level, one block per group, CUDA streams) in the training step; docs/training.md says
           why it is not expected to survive the backward pass: this variant settles it on a GPU.

Prints one JSON line per measurement, and appends each as it comes to a dated section of the
BENCHMARKS.md beside this folder (a run cut short keeps what it measured; on a remote copy of the
checkout, bring that file back). SD1.5 and SDXL together outlast a 10-minute command on an H100,
most of it the two compilations (BENCHMARKS.md); each flow setting writes its model once (minutes
for Flux.1's 34 GB) and takes fewer, longer steps (FLOW_TIMING). Where a command's time is limited,
run one setting per command; on a 64 GiB disk
delete ROOT/models/<arch> before the next family's:

    python -m benchmarks.gpu_bench [--root DIR] [--only NAME ...]

It needs torch, transformers, accelerate, peft, safetensors, diffusers, webdataset, pydantic, blake3,
pillow and tokenizers (not prefect); where some are missing and there is no network, install their
wheels and those of their own dependencies first, e.g.
`pip install --no-index --no-deps --target /tmp/site WHEELS && export PYTHONPATH=/tmp/site`.

    python -m benchmarks.gpu_bench --smoke [--root DIR] [--only NAME ...]

runs the same code, every setting, on the tiny model of its family at 64 px in fp32 (on the GPU if
there is one), shorter, without the compiled variant, and prints only: tests/test_gpu_bench.py runs
it on the CPU.
"""
from __future__ import annotations

import argparse
import importlib
import json
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from .common import (ResultsSection, Timing, arch_folder, device_sync, generated_clips, generated_images, interleaved,
                     random_model, release_memory, tiny_arch, tiny_model)
from .encode_bench import bare_forward_seconds, encode_inputs, load_encoders, run_encode
from .train_bench import cached_step, step_calls, step_figures, training_recipe

if TYPE_CHECKING:
    import torch

    from lorapipe.stages.encode import EncodeInputs
    from lorapipe.stages.train.recipe import LoRATrainingRecipe

LORA_RANK = 16
COMPILED, OFFLOADED = "+compile", "+offload"
QUANTISED = ("int8", "fp8", "nf4")  # train.base_quantization settings beside each bf16 flow setting
# dense (no sparsity) bf16 tensor-core peaks, FLOP/s, by the first name part torch.cuda.get_device_name() contains
PEAK_BF16_FLOPS = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12),
                   ("A100", 312e12))


@dataclass(frozen=True)
class Setting:
    arch: str  # a folder of stages/assets/arch/ (smoke: the tiny model of its family)
    resolution: int
    batch: int  # training micro-batch
    images: int  # encoded, then trained on
    encode_batch: int
    variants: tuple[str, ...]  # of the cached step: "sdpa" or "classic" attention, + COMPILED to compile
    gradient_checkpointing: bool = False
    timing: Timing | None = None  # None: the mode's
    base_quantization: str = "none"  # train.base_quantization
    blocks_to_swap: int | float | None = None  # train.blocks_to_swap
    frames: int = 0  # clips of this many frames (preprocess.video.num_frames); 0: images
    size: tuple[int, int] | None = None  # (width, height) of every clip, a multiple of 64; None: square


@dataclass(frozen=True)
class Mode:
    full_size: bool  # random weights at the published sizes, else the tiny test models
    settings: dict[str, Setting]  # by the name measurements are printed under (--only)
    timing: Timing
    encode_dtype: str  # the encode stage's record dtype
    mixed_precision: str  # the recipe's
    encode_workers: int  # the encode stage's decode threads


# images: enough that loading the encoders (seconds, also in the stage's time) does not swamp the encode rate;
# the flow-matching transformers' steps take seconds: fewer of them, so that a setting fits a 10-minute command
FLOW_TIMING = Timing(warmup=2, rounds=2, steps=5)
CLIP_TIMING = Timing(warmup=1, rounds=1, steps=3)  # a 14B step over 30k tokens takes several seconds
GPU = Mode(True, {
    "sd15": Setting("sd15", 512, 8, 256, 16, ("sdpa", "classic", "sdpa" + COMPILED)),
    "sdxl": Setting("sdxl", 1024, 4, 128, 8, ("sdpa", "sdpa" + COMPILED)),
    "flux1": Setting("flux1", 1024, 1, 32, 4, ("sdpa", "sdpa" + COMPILED, "sdpa" + OFFLOADED), True, FLOW_TIMING),
    **{f"flux1-{q}": Setting("flux1", 1024, 1, 32, 4, ("sdpa", "sdpa" + OFFLOADED), True, FLOW_TIMING, q)
       for q in QUANTISED},
    "flux1-no-checkpointing": Setting("flux1", 1024, 1, 32, 4, ("sdpa",), False, FLOW_TIMING),
    "flux2-klein": Setting("flux2-klein", 1024, 1, 32, 4, ("sdpa", "sdpa" + COMPILED), False, FLOW_TIMING),
    **{"flux2-klein-9b" + ("" if q == "none" else f"-{q}"):
       Setting("flux2-klein-9b", 1024, 1, 32, 4, ("sdpa", "sdpa" + OFFLOADED), True, FLOW_TIMING, q)
       for q in ("none", *QUANTISED)},
    "flux2-klein-9b-swap": Setting("flux2-klein-9b", 1024, 1, 32, 4, ("sdpa",), True, FLOW_TIMING, blocks_to_swap=0.5),
    "z-image": Setting("z-image", 1024, 1, 32, 4, ("sdpa", "sdpa" + COMPILED), False, FLOW_TIMING),
    **{"wan2.1-14b" + suffix: Setting("wan2.1-14b", 640, 1, 4, 1, ("sdpa",), True, CLIP_TIMING, blocks_to_swap=swap,
                                      frames=81, size=(832, 448)) for suffix, swap in (("", None), ("-swap", 40))},
}, Timing(warmup=3, rounds=3, steps=10), "bfloat16", "bf16", 4)
def tiny_swap(blocks_to_swap: int | float | None) -> int | float | None:
    """A setting's train.blocks_to_swap on the tiny model: a fraction as it is, a count as one block."""
    return 1 if isinstance(blocks_to_swap, int) else blocks_to_swap


SMOKE = Mode(False, {  # each GPU setting on the tiny model of its arch's family, its checkpointing kept
    name: Setting(setting.arch, 64, 2, 8, 4, tuple(v for v in setting.variants if not v.endswith(COMPILED)),
                  setting.gradient_checkpointing, base_quantization=setting.base_quantization,
                  blocks_to_swap=tiny_swap(setting.blocks_to_swap), frames=min(setting.frames, 5))
    for name, setting in GPU.settings.items()
}, Timing(warmup=1, rounds=2, steps=2), "float32", "no", 0)


# ---- 1. model
def model_figures(setting: Setting, mode: Mode, root: Path, device: torch.device) -> tuple[dict, Path]:
    """Figures (built_s null: reused) and the model folder (one per arch, shared by its settings)."""
    if not mode.full_size:
        arch = tiny_arch(setting.arch)
        return {"weights": "tiny test model", "arch": arch}, tiny_model(root / "models", arch)
    model, built_s = root / "models" / setting.arch, None
    if not (model / "model_index.json").exists():
        started = time.perf_counter()
        random_model(arch_folder(setting.arch), model, device)
        built_s = round(time.perf_counter() - started, 1)
    return {"weights": "random, published architecture", "arch": setting.arch, "built_s": built_s}, model


# ---- 2. encode
def import_encoder_classes(model: Path) -> None:
    """Import the classes of the model's encode components, so that the encoders' load time leaves
    the imports out."""
    from lorapipe.stages.families import for_model
    from lorapipe.stages.families.folders import model_index

    index = model_index(model)
    for name in for_model(model).components.for_stage("encode"):
        library, class_name = index[name]
        getattr(importlib.import_module(library), class_name)


def encode_figures(name: str, setting: Setting, mode: Mode, model: Path, root: Path,
                   device: torch.device) -> tuple[dict, EncodeInputs, Path]:
    """Figures, the encode inputs, and the encode artifact's folder."""
    import torch

    import_encoder_classes(model)
    n, size = setting.images, setting.size or (setting.resolution, setting.resolution)
    if setting.frames:
        data = generated_clips(root / f"clips-{n}-{setting.frames}x{size[0]}x{size[1]}", n, setting.frames, size)
        preprocess = {"video": {"num_frames": setting.frames}, **({"buckets": True, "bucket_sizes": (size,)}
                                                                 if setting.size else {})}
    else:
        data, preprocess = generated_images(root / f"images-{n}-{setting.resolution}px", n, setting.resolution), {}
    cache = root / f"gpu-bench-{name}"
    shutil.rmtree(cache, ignore_errors=True)
    inputs = encode_inputs(data, cache, model, setting.resolution, **preprocess)
    started = time.perf_counter()
    encoders = load_encoders(inputs, str(device), getattr(torch, mode.encode_dtype))
    load_s = time.perf_counter() - started
    bare_s = bare_forward_seconds(inputs, n, encoders, setting.encode_batch)
    del encoders
    release_memory(device)
    started = time.perf_counter()
    run_encode(inputs, cache / "encoded", mode.encode_workers, setting.encode_batch, mode.encode_dtype)
    stage_s = time.perf_counter() - started
    return {
        "images": n, "frames": setting.frames, "resolution": setting.size or setting.resolution,
        "batch": setting.encode_batch, "dtype": mode.encode_dtype,
        "decode_threads": mode.encode_workers, "stage_img_s": round(n / stage_s, 1), "bare_img_s": round(n / bare_s, 1),
        "ratio": round(bare_s / stage_s, 3), "encoders_load_s": round(load_s, 2),
        "ratio_without_load": round(bare_s / (stage_s - load_s), 3),
    }, inputs, cache / "encoded"


# ---- 3. train steps and 4. variants
def peak_bf16_flops(device: torch.device) -> tuple[str, float | None]:
    import torch

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return name, next((peak for part, peak in PEAK_BF16_FLOPS if part in name), None)


def step_flops(recipe: LoRATrainingRecipe) -> int:
    """FLOPs of one forward + backward of the recipe's denoiser step (the optimizer's are negligible;
    with gradient checkpointing, the recomputed forward is counted)."""
    from torch.utils.flop_counter import FlopCounterMode

    from lorapipe.stages.train.recipe import step_loss

    inputs, device = recipe._prepare(0), recipe.accelerator.device
    with FlopCounterMode(display=False) as counter:
        expert = recipe.experts[0]
        recipe.accelerator.backward(step_loss(expert.family, expert.objective, expert.denoiser, inputs, device,
                                              recipe.dtype))
    recipe.optimizer.zero_grad(set_to_none=True)
    return counter.get_total_flops()


@contextmanager
def cached_step_variant(recipe: LoRATrainingRecipe, variant: str) -> Iterator[None]:
    """The recipe's denoiser with the variant's attention: "sdpa" its own processors (diffusers'
    scaled-dot-product ones), "classic" diffusers' AttnProcessor (for the UNets' Attention modules
    only); compiled for COMPILED; as it was after, except OFFLOADED's group offloading, which stays."""
    import torch
    from diffusers.models.attention_processor import AttnProcessor

    expert = recipe.experts[0]
    denoiser, prepared = recipe._lora_denoiser(expert), expert.denoiser
    classic = variant.removesuffix(COMPILED) == "classic"
    processors = denoiser.attn_processors if classic else None
    if classic:
        denoiser.set_attn_processor(AttnProcessor())
    if variant.endswith(OFFLOADED):
        device = recipe.accelerator.device
        denoiser.enable_group_offload(device, torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1,
                                      use_stream=device.type == "cuda")
    if variant.endswith(COMPILED):
        expert.denoiser = torch.compile(prepared)
    try:
        yield
    finally:
        expert.denoiser = prepared
        if classic:
            denoiser.set_attn_processor(processors)
        if variant.endswith(COMPILED):
            torch._dynamo.reset()  # drops the compiled graphs


def variant_figures(recipe: LoRATrainingRecipe, variant: str, timing: Timing, flops: int,
                    device: torch.device) -> dict:
    import torch

    sync, step, cuda = device_sync(device), cached_step(recipe), device.type == "cuda"
    with cached_step_variant(recipe, variant):
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        sync()
        started = time.perf_counter()
        step(0)
        sync()
        first_s = time.perf_counter() - started
        seconds = interleaved({variant: step}, timing, sync)[variant]
        peak_mib = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None
    peak = peak_bf16_flops(device)[1]
    compile_note = {"note": "first_step_s is the compilation, which step_ms leaves out"}
    return {
        "variant": variant, **(compile_note if variant.endswith(COMPILED) else {}), "step_ms": round(seconds * 1e3, 2),
        "it_s": round(1 / seconds, 2), "first_step_s": round(first_s, 2),
        "peak_gpu_mib": None if peak_mib is None else round(peak_mib), "tflop_per_step": _digits(flops / 1e12),
        "achieved_tflop_s": _digits(flops / seconds / 1e12), "mfu": round(flops / seconds / peak, 3) if peak else None,
    }


def _digits(value: float) -> float:
    return float(f"{value:.4g}")  # the tiny smoke models' TFLOPs would round to 0


def train_figures(setting: Setting, mode: Mode, inputs: EncodeInputs, encoded: Path,
                  device: torch.device) -> Iterator[tuple[str, dict]]:
    import torch

    timing, checkpointing = setting.timing or mode.timing, setting.gradient_checkpointing
    quantization, swap = setting.base_quantization, setting.blocks_to_swap
    recipe = training_recipe(inputs, encoded, encoded.parent / "work", setting.batch, mode.mixed_precision,
                             LORA_RANK, gradient_checkpointing=checkpointing, base_quantization=quantization,
                             blocks_to_swap=swap)
    inline = training_recipe(inputs, encoded, encoded.parent / "work-inline", setting.batch, mode.mixed_precision,
                             LORA_RANK, loader_workers=0, gradient_checkpointing=checkpointing,
                             base_quantization=quantization, blocks_to_swap=swap)
    try:
        seconds = interleaved(step_calls(recipe, inline, inputs), timing, device_sync(device))
        del inline
        release_memory(device)  # the on-the-fly step's VAE and text encoders, the inline recipe's denoiser
        expert = recipe.experts[0]
        params = list(recipe._lora_denoiser(expert).parameters())
        on_host = [t for s in expert.block_swap.swapped.values() for t in s.kept] if expert.block_swap else []
        gpu, peak = peak_bf16_flops(device)
        yield "train steps", {
            "resolution": setting.size or setting.resolution, "frames": setting.frames, "batch": setting.batch, "mixed_precision": mode.mixed_precision,
            "gradient_checkpointing": checkpointing, "base_quantization": quantization, "blocks_to_swap": swap,
            "lora_rank": LORA_RANK,
            "denoiser_params_m": round(sum(t.numel() for t in params + on_host) / 1e6, 1),  # swapped ones too
            "lora_params_m": round(sum(p.numel() for p in params if p.requires_grad) / 1e6, 2),
            "steps": str(timing), "torch_threads": torch.get_num_threads(), "device": gpu,
            "dense_bf16_peak_tflop_s": peak / 1e12 if peak else None,
            **({} if peak else {"mfu_note": f"mfu is null: no dense bf16 peak known for {gpu}"}),
            **step_figures(seconds, setting.batch),
        }
        flops = step_flops(recipe)
        for variant in setting.variants:
            yield f"cached step {variant}", _variant_or_error(recipe, variant, timing, flops, device)
    finally:
        recipe.batches.close()


def _variant_or_error(recipe: LoRATrainingRecipe, variant: str, timing: Timing, flops: int,
                      device: torch.device) -> dict:
    try:
        return variant_figures(recipe, variant, timing, flops, device)
    except Exception as error:  # compile errors, out of memory: reported, the other variants still run
        recipe.batches.close()  # a failed step took its micro-batch without counting the step
        recipe.batches = recipe.micro_batches()
        release_memory(device)
        return {"variant": variant, "error": error_line(error)}


def error_line(error: Exception) -> str:
    return f"{type(error).__name__}: {next(iter(str(error).strip().splitlines()), '')}"


# ---- the run
def measurements(mode: Mode, names: list[str], root: Path) -> Iterator[tuple[str, dict]]:
    """(name, figures) of every measurement, each yielded as soon as it is taken."""
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.ones(1, device=device)  # the CUDA context now, not inside the first timing
    else:
        torch.set_num_threads(1)  # as train_bench: on shared cores a two-thread step was up to 10x slower
    for name in names:
        try:
            yield from setting_measurements(name, mode.settings[name], mode, root, device)
        except Exception as error:  # out of memory at full size: reported, the next settings still run
            yield f"{name} error", {"error": error_line(error)}
        release_memory(device)


def setting_measurements(name: str, setting: Setting, mode: Mode, root: Path,
                         device: torch.device) -> Iterator[tuple[str, dict]]:
    figures, model = model_figures(setting, mode, root, device)
    yield f"{name} model", figures
    figures, inputs, encoded = encode_figures(name, setting, mode, model, root, device)
    yield f"{name} encode", figures
    for measured, figures in train_figures(setting, mode, inputs, encoded, device):
        yield f"{name} {measured}", figures


def measure(root: Path) -> dict | str:
    """Every measurement of the GPU run, by name (for `python -m benchmarks`)."""
    import torch

    if not torch.cuda.is_available():
        return "skipped: no CUDA device (python -m benchmarks.gpu_bench --smoke runs its code on the CPU)"
    return dict(measurements(GPU, list(GPU.settings), root))


def main(argv: list[str] | None = None) -> None:
    import torch

    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path("bench-run"))
    parser.add_argument("--smoke", action="store_true", help="tiny models at 64 px in fp32; prints only")
    parser.add_argument("--only", choices=list(GPU.settings), action="append",
                        help="this setting only (repeatable); default: every setting")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: --smoke runs the same code on the tiny models on the CPU")
    mode, names = (SMOKE if args.smoke else GPU), args.only or list(GPU.settings)
    args.root.mkdir(parents=True, exist_ok=True)
    section = None if args.smoke else ResultsSection(
        " ".join(["python -m benchmarks.gpu_bench", *(f"--only {name}" for name in args.only or [])]))
    for name, figures in measurements(mode, names, args.root.resolve()):
        print(json.dumps({"measurement": name, **figures}), flush=True)
        if section:
            section.add(name, figures)


if __name__ == "__main__":
    main()
