"""Encode's CPU side on camera-size photos: decode + resize + crop images/s, the full decode encode
used before (open, EXIF turn, RGB, bicubic resize) against ours (a JPEG decoded at a reduced DCT
scale first), with 1 and 2 decode threads, for 512 px (SD1.5) and 1024 px (SDXL) targets.

Next to a GPU VAE these rates, times the host's cores, bound encode's images/s. The photos are a
shipped photo upscaled to 4000x3000 with sensor-like grain, saved as JPEG quality 90 (~2 MB).
"""
from __future__ import annotations

import io
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PHOTOS, SIDE = 16, (4000, 3000)
DEMO_PHOTO = Path(__file__).resolve().parent.parent / "stages" / "assets" / "demo_images" / "coffee.jpg"


def camera_photos(folder: Path) -> list[bytes]:
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    base = np.asarray(Image.open(DEMO_PHOTO).convert("RGB").resize(SIDE, Image.BICUBIC), dtype=np.int16)
    for i in range(PHOTOS):
        path = folder / f"photo{i:02d}.jpg"
        if not path.exists():
            grain = np.random.default_rng(i).normal(0, 6, base.shape).astype(np.int16)
            Image.fromarray((base + grain).clip(0, 255).astype(np.uint8)).save(path, quality=90)
    return [p.read_bytes() for p in sorted(folder.glob("photo*.jpg"))]


def full_decode(data: bytes, size: tuple[int, int]):
    from PIL import Image, ImageOps

    with Image.open(io.BytesIO(data)) as im:
        return ImageOps.exif_transpose(im).convert("RGB").resize((size[1], size[0]), Image.BICUBIC)


def reduced_decode(data: bytes, size: tuple[int, int]):
    from PIL import Image

    from lorapipe.stages.encode.images import resized_upright

    with Image.open(io.BytesIO(data)) as im:
        return resized_upright(im, size, None)


def images_per_second(decode, photos: list[bytes], size: tuple[int, int], threads: int) -> float:
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda data: decode(data, size), photos * 2))
    return 2 * len(photos) / (time.perf_counter() - started)


def rates(root: Path) -> list[dict]:
    photos = camera_photos(root / "photos-4000x3000")
    rows = []
    for target in (512, 1024):
        size = (target, target * SIDE[0] // SIDE[1])  # the short side at the target, as preprocess resizes
        row = {"target_px": target}
        for name, decode in (("full", full_decode), ("reduced", reduced_decode)):
            for threads in (1, 2):
                row[f"{name}_{threads}t_img_s"] = round(images_per_second(decode, photos, size, threads), 1)
        row["reduced_over_full_1t"] = round(row["reduced_1t_img_s"] / row["full_1t_img_s"], 2)
        rows.append(row)
    return rows
