"""Where each image lands: its target size (a square, or an aspect-ratio bucket) and crop box.

An image is resized (aspect kept) until it covers its target, then cropped to it. The crop is
centred, or placed at random once per image from (seed, image digest): with cached latents a
random crop is one fixed crop per image, not a new one each epoch, and renaming the file keeps it.
"""
from __future__ import annotations

import math
import random

from blake3 import blake3

STEP = 64  # bucket sides, and sides shrunk by never_upscale, are multiples of this


def generated_buckets(resolution: int, max_aspect: float) -> list[tuple[int, int]]:
    """(width, height) pairs, multiples of STEP, each the largest of its width within resolution²
    pixels and at most `max_aspect` long-to-short, in both orientations."""
    area, buckets = resolution * resolution, set()
    for width in range(STEP, int(resolution * math.sqrt(max_aspect)) + 1, STEP):
        height = area // width // STEP * STEP
        if height >= STEP and max(width, height) / min(width, height) <= max_aspect:
            buckets |= {(width, height), (height, width)}
    return sorted(buckets)


def nearest_bucket(width: int, height: int, buckets: list[tuple[int, int]]) -> tuple[int, int]:
    """The bucket whose aspect ratio is closest to the image's (in log scale; ties: the first)."""
    aspect = math.log(width / height)
    return min(buckets, key=lambda b: abs(math.log(b[0] / b[1]) - aspect))


def shrink_to_fit(width: int, height: int, target: tuple[int, int]) -> tuple[int, int] | None:
    """The target scaled down (sides rounded down to STEP) so the image need not be upscaled;
    None when that leaves a side under STEP."""
    scale = max(target[0] / width, target[1] / height)
    if scale <= 1:
        return target
    fitted = (int(target[0] / scale) // STEP * STEP, int(target[1] / scale) // STEP * STEP)
    return fitted if min(fitted) >= STEP else None


def place(width: int, height: int, target: tuple[int, int], random_crop: bool, seed: int,
          image_digest: str) -> tuple[list[int], list[int]]:
    """Resize to cover `target` (width, height), then crop: (resized [h, w], box [l, t, r, b])."""
    tw, th = target
    scale = max(tw / width, th / height)
    w, h = max(tw, round(width * scale)), max(th, round(height * scale))
    if random_crop:
        rng = random.Random(blake3(f"{seed}:{image_digest}".encode()).digest()[:8])
        left, top = rng.randint(0, w - tw), rng.randint(0, h - th)
    else:
        left, top = (w - tw) // 2, (h - th) // 2
    return [h, w], [left, top, left + tw, top + th]

