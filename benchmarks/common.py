"""Shared set-up for the benchmarks: generated image folders and a tiny model under one root, timing
in interleaved rounds, and the dated sections they append to BENCHMARKS.md."""
from __future__ import annotations

import gc
import json
import os
import platform
import random
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SEED = 0  # of every random-weight model
BENCHMARKS_MD = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"


def generated_images(folder: Path, count: int, size: int = 64, seed: int = 0) -> Path:
    """`count` random-noise PNGs of `size` x `size` with captions (kept if already there)."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for i in range(count):
        path = folder / f"img{i:06d}.png"
        if path.exists():
            continue
        pixels = np.random.default_rng(seed * 1_000_003 + i).integers(0, 255, (size, size, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(path, compress_level=1)
        path.with_suffix(".txt").write_text(f"a generated image number {i} of {rng.choice(['red', 'blue'])} noise")
    return folder


def generated_clips(folder: Path, count: int, frames: int, size: tuple[int, int], fps: int = 16) -> Path:
    """`count` mp4 clips of `frames` frames, (width, height) `size`, with captions (kept if already
    there): random noise sliding sideways, so every frame differs."""
    import numpy as np

    from lorapipe.stages.demo.clips import write_clip

    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        path = folder / f"clip{i:04d}.mp4"
        if not path.exists():
            noise = np.random.default_rng(i).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
            write_clip(path, (np.roll(noise, 4 * k, axis=1) for k in range(frames)), fps)
        path.with_suffix(".txt").write_text(f"generated clip number {i}, noise sliding sideways")
    return folder


def tiny_model(root: Path, arch: str = "sd15") -> Path:
    from lorapipe.stages.families import build_tiny_model

    model = root / f"tiny-{arch}"
    if not (model / "model_index.json").exists():
        build_tiny_model(model, arch)
    return model


# ---- random weights at a published size
def arch_folder(arch: str) -> Path:
    from lorapipe.stages.families.single_file import ARCH_ROOT

    return ARCH_ROOT / arch


def tiny_arch(arch: str) -> str:
    """The tiny model of the family (and variant) of stages/assets/arch/<arch>/."""
    from lorapipe.stages.families import for_model

    return for_model(arch_folder(arch)).variant.tiny_arch


def _check_tokenizer(tokenizer, text_encoder_dir: Path) -> None:
    from transformers import AutoConfig

    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's
    vocab_size = AutoConfig.from_pretrained(text_encoder_dir).get_text_config().vocab_size  # a VL model's: its text's
    if len(tokenizer) > vocab_size:
        raise ValueError(f"the tiny model's tokenizer (vocabulary of {len(tokenizer)}) does not fit"
                         f" {text_encoder_dir}/config.json's vocab_size {vocab_size}")


@contextmanager
def _created_in(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Modules created in this block are initialised on `device` in `dtype`: seconds on a GPU
    (minutes for SDXL on a CPU), and half the memory of float32 (Flux.1's transformer: 24 GB)."""
    import torch

    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(default)


def _random_component(arch_dir: Path, name: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Component `name` of arch_dir with seeded random weights, its class as model_index.json names it
    (a diffusers pipeline's own module too: LTX-2's connectors)."""
    import torch

    from lorapipe.stages.families.folders import component_class

    cls, config_dir = component_class(arch_dir, name), arch_dir / name
    torch.manual_seed(SEED)
    with _created_in(device, dtype):
        if hasattr(cls, "load_config"):  # diffusers' ConfigMixin
            model = cls.from_config(cls.load_config(config_dir))
        else:
            model = cls(cls.config_class.from_pretrained(config_dir))
    return model.to(dtype).cpu()


def random_model(arch_dir: Path, out: Path, device: torch.device, dtype: str = "bfloat16",
                 text_dtype: str | None = None, vae_dtype: str | None = None) -> Path:
    """A diffusers folder of the architecture in `arch_dir` (a folder of stages/assets/arch/) at its
    published size: seeded random weights in `dtype`, the text stage's models in `text_dtype` (default:
    `dtype`), as published models store their text encoders in bf16, which encode then runs them in,
    and the VAE in `vae_dtype` (default: `dtype`), which evaluate decodes in.
    The configs hold no tokenizer vocabularies: the tokenizers (and processors) of the family's tiny
    model (built offline) instead, under the classes that wrote them, checked to fit the text
    encoders' embeddings."""
    import torch

    from lorapipe.stages.families import for_model
    from lorapipe.stages.families.folders import is_component, load_component, model_index

    family, staging = for_model(arch_dir), out.with_name(f"{out.name}.partial")
    tiny = tiny_model(out.parent, family.variant.tiny_arch)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    index = dict(model_index(arch_dir))
    texts = [name for name, spec in index.items() if is_component(spec) and _is_text_input(name)]
    index.update({name: model_index(tiny)[name] for name in texts})
    (staging / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    for name in texts:
        shutil.copytree(tiny / name, staging / name)
        encoder = "text_encoder" if name == "processor" else name.replace("tokenizer", "text_encoder")
        _check_tokenizer(load_component(staging, name), arch_dir / encoder)
    for name, spec in index.items():
        if not is_component(spec) or name in texts:
            continue
        if name == "scheduler":
            shutil.copytree(arch_dir / name, staging / name)
        else:
            stored = (text_dtype if text_dtype and name in family.components.text else
                      vae_dtype if vae_dtype and name in family.components.latent else dtype)
            _random_component(arch_dir, name, device, getattr(torch, stored)).save_pretrained(
                staging / name, safe_serialization=True)
            release_memory(device)
    staging.rename(out)
    return out


def _is_text_input(name: str) -> bool:
    """A tokenizer or processor: files with vocabularies, which the arch folders do not ship."""
    return name.startswith("tokenizer") or name == "processor"


def release_memory(device: torch.device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def full_size_sd15(root: Path) -> Path:
    """SD1.5 at its published size with random weights (stages/assets/arch/sd15), built once under ROOT/models/sd15."""
    import torch

    model = root / "models" / "sd15"
    if not (model / "model_index.json").exists():
        random_model(arch_folder("sd15"), model, torch.device("cpu"))
    return model


def full_size_cli(module: str, description: str, result_name: str, measure: Callable[[Path, bool], dict]) -> None:
    """The command line of a benchmark over the tiny models or, with --full-size, full_size_sd15:
    print `measure(root, full_size)` and append it to BENCHMARKS.md under the command that made it."""
    import argparse

    prog = f"python -m {module}"
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--root", type=Path, default=Path("bench-run"))
    parser.add_argument("--full-size", action="store_true", help="SD1.5 at its published size, not the tiny models")
    args = parser.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    result = measure(args.root.resolve(), args.full_size)
    print(json.dumps(result, indent=1))
    ResultsSection(prog + (" --full-size" if args.full_size else "")).add(result_name, result)


def pipeline_config(root: Path, folder: str, images: int, train: dict, evaluate: dict) -> Path:
    """root/folder, emptied, holding a config.yaml that runs the tiny SD1.5 model on `images`
    generated images (64 px, 1% held out), its cache and outputs inside the folder."""
    import yaml

    work = root / folder
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    config = work / "config.yaml"
    config.write_text(yaml.safe_dump({
        "name": folder, "cache_dir": "cache", "output_dir": "out", "model": {"path": str(tiny_model(root))},
        "data": {"path": str(generated_images(root / f"images-{images}", images))},
        "preprocess": {"resolution": 64, "holdout_fraction": 0.01}, "encode": {"batch_size": 16},
        "train": train, "evaluate": {"seeds": [0], "loss_timesteps": [500], **evaluate},
    }))
    return config


def machine() -> str:
    import torch

    cores = f"{os.cpu_count()} cores" + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "")
    return f"{platform.node()} {cores}, torch {torch.__version__}, python {platform.python_version()}"


def device_sync(device: torch.device) -> Callable[[], None]:
    """What waits for the work queued on `device` (CUDA kernels run asynchronously to Python)."""
    import torch

    return torch.cuda.synchronize if device.type == "cuda" else lambda: None


@dataclass(frozen=True)
class Timing:
    warmup: int  # calls of each variant before any round
    rounds: int
    steps: int  # calls per round

    def __str__(self) -> str:
        return f"{self.rounds}x{self.steps}, fastest round"


def interleaved(calls: dict[str, Callable[[int], object]], timing: Timing,
                sync: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Seconds per call of each variant: rounds of `timing.steps` calls taken in turn, the fastest
    round kept. Call i gets i, counting from 0 over its warm-up and rounds."""
    for call in calls.values():
        for i in range(timing.warmup):
            call(i)
    best = {name: float("inf") for name in calls}
    for r in range(timing.rounds):
        for name, call in calls.items():
            sync()
            started = time.perf_counter()
            for i in range(timing.steps):
                call(timing.warmup + r * timing.steps + i)
            sync()
            best[name] = min(best[name], (time.perf_counter() - started) / timing.steps)
    return best


class ResultsSection:
    """A dated section of BENCHMARKS.md: a heading with the machine, the command, then one line per
    result, each appended as it comes so that a run cut short keeps what it measured."""

    def __init__(self, command: str, path: Path = BENCHMARKS_MD):
        self.path = path
        self.heading = [f"\n### {time.strftime('%Y-%m-%d %H:%M')} — {machine()}", "", f"Command: `{command}`", ""]

    def add(self, name: str, result: object) -> None:
        lines, self.heading = [*self.heading, f"- {name}: `{json.dumps(result)}`"], []
        with open(self.path, "a") as f:
            f.write("\n".join(lines) + "\n")
