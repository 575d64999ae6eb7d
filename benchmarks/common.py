"""Shared set-up for the benchmarks: generated image folders and a tiny model, under one root."""
from __future__ import annotations

import os
import platform
import random
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def generated_images(folder: Path, count: int, size: int = 64, seed: int = 0) -> Path:
    """`count` small random-noise PNGs with captions (kept if already there)."""
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


def tiny_model(root: Path) -> Path:
    from stages.tiny import build_tiny_model

    model = root / "tiny-sd15"
    if not (model / "model_index.json").exists():
        build_tiny_model(model)
    return model


def machine() -> str:
    import torch

    return f"{platform.node()} {os.cpu_count()} cores, torch {torch.__version__}, python {platform.python_version()}"
