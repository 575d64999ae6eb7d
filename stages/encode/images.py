"""Pixel work, in decode threads: read, check, decode, orient, convert to RGB, resize, crop, flip."""
from __future__ import annotations

import io
from typing import TYPE_CHECKING

from PIL import Image, ImageOps

from cache.digest import digest_bytes

from ..preprocess.sources import DatasetSource, read_image_bytes

if TYPE_CHECKING:  # torch is imported where encoding happens, not by config loading
    import torch


def sample_label(sample: dict, datasets: tuple[DatasetSource, ...]) -> str:
    """The file as the user knows it: its path, prefixed by its dataset's name when there are several."""
    return f"{datasets[sample['source']].label}/{sample['path']}" if len(datasets) > 1 else sample["path"]


def to_rgb(im: Image.Image, background: tuple[int, int, int] | None) -> Image.Image:
    """Grayscale, 16-bit, palette, CMYK and alpha images as RGB; alpha composited on `background`."""
    if im.mode.startswith("I;16"):  # convert("RGB") would clip 16-bit values instead of scaling them
        im = im.convert("I").point(lambda v: v / 256, "L")
    if background is not None and (im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in im.info):
        canvas = Image.new("RGBA", im.size, (*background, 255))
        return Image.alpha_composite(canvas, im.convert("RGBA")).convert("RGB")
    return im.convert("RGB")


class ImageCrops:
    """A map-style dataset of (latent job index, pixels in [-1, 1] or None, why it failed): a broken
    file, or one whose bytes changed since preprocess, is reported, never raised."""

    def __init__(self, datasets: tuple[DatasetSource, ...], samples: list[dict], flips: list[bool]):
        self.datasets, self.samples, self.flips = datasets, samples, flips

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor | None, str]:
        import torch

        s = self.samples[i]
        try:
            data = read_image_bytes(self.datasets[s["source"]], s["path"])
            if digest_bytes(data) != s["digest"]:
                return i, None, "changed since preprocess ran (run the pipeline again)"
            with Image.open(io.BytesIO(data)) as im:
                im = to_rgb(ImageOps.exif_transpose(im), s.get("background"))
            h, w = s["resized"]
            im = im.resize((w, h), Image.BICUBIC).crop(tuple(s["crop_box"]))
            if self.flips[i]:
                im = im.transpose(Image.FLIP_LEFT_RIGHT)
            pixels = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8)
        except (OSError, ValueError, SyntaxError) as e:
            return i, None, f"cannot decode ({type(e).__name__}: {e})"
        return i, pixels.view(im.height, im.width, 3).permute(2, 0, 1).float() / 127.5 - 1.0, ""


def size_batches(sizes: list[tuple[int, int]], batch_size: int) -> list[list[int]]:
    """Index batches of at most `batch_size`, each of one size (one VAE call per batch).
    Expects indices already grouped by size, as the latent jobs are (sorted by size, then key)."""
    batches: list[list[int]] = []
    for i, size in enumerate(sizes):
        if batches and sizes[batches[-1][0]] == size and len(batches[-1]) < batch_size:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches
