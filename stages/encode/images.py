"""Pixel work, in decode threads: read, check, decode, orient, convert to RGB, resize, crop, flip.

An image becomes (3, H, W) pixels; a clip's window (ImageRow.frames) becomes (3, F, H, W):
each frame decoded upright (stages/video.py), checked against the window's digest, then resized,
cropped and mirrored as an image of the clip's size is."""
from __future__ import annotations

import io
from typing import TYPE_CHECKING, Callable

from PIL import ExifTags, Image

from lorapipe.cache.digest import digest_bytes, digest_json

from ..preprocess.rows import ImageRow
from ..preprocess.sources import DatasetSource, local_file, read_image_bytes
from ..preprocess.validation import TRANSPOSED
from ..video import VideoProblem, decode_frames, frame_digest

if TYPE_CHECKING:  # torch is imported where encoding happens, not by config loading
    import torch

EXIF_TRANSPOSE = {  # EXIF orientation -> the turn that shows the image upright
    2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def to_rgb(im: Image.Image, background: tuple[int, int, int] | None) -> Image.Image:
    """Grayscale, 16-bit, palette, CMYK and alpha images as RGB; alpha composited on `background`."""
    if im.mode.startswith("I;16"):  # convert("RGB") would clip 16-bit values instead of scaling them
        im = im.convert("I").point(lambda v: v / 256, "L")
    if background is not None and (im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in im.info):
        canvas = Image.new("RGBA", im.size, (*background, 255))
        return Image.alpha_composite(canvas, im.convert("RGBA")).convert("RGB")
    return im.convert("RGB")


def resized_upright(im: Image.Image, size: tuple[int, int], background: tuple[int, int, int] | None) -> Image.Image:
    """RGB, resized to `size` (height, width as shown) with bicubic filtering, then turned upright
    by its EXIF orientation. A JPEG is decoded at the smallest 1/2, 1/4 or 1/8 scale still twice
    the size (PIL's reducing gap): much faster on camera photos, close to a full decode
    (BENCHMARKS.md)."""
    return upright_resized(im, size, lambda decoded: to_rgb(decoded, background))


def upright_resized(im: Image.Image, size: tuple[int, int], convert: Callable[[Image.Image], Image.Image]
                    ) -> Image.Image:
    """convert(im) resized to `size` as resized_upright does (the geometry images and their loss
    masks share)."""
    orientation = im.getexif().get(ExifTags.Base.Orientation, 1)
    height, width = size
    if orientation in TRANSPOSED:
        height, width = width, height
    drafted = im.draft(None, (2 * width, 2 * height)) if im.format == "JPEG" else None
    box = drafted[1] if drafted else None  # the full image's extent in decoded pixels
    im = convert(im).resize((width, height), Image.BICUBIC, box=box)
    turn = EXIF_TRANSPOSE.get(orientation)
    return im.transpose(turn) if turn is not None else im


def placed(im: Image.Image, sample: ImageRow, flip: bool, convert: Callable[[Image.Image], Image.Image]
           ) -> Image.Image:
    """convert(im) upright, resized and cropped as preprocess placed the sample, mirrored if `flip`."""
    im = upright_resized(im, sample.resized, convert).crop(sample.crop_box)
    return im.transpose(Image.FLIP_LEFT_RIGHT) if flip else im


def placed_image(datasets: tuple[DatasetSource, ...], s: ImageRow, flip: bool = False) -> Image.Image | None:
    """The sample's image, RGB, placed as preprocess decided (mirrored with `flip`); None when its
    bytes changed since preprocess. Raises OSError, ValueError or SyntaxError on a broken file."""
    data = read_image_bytes(datasets[s.source], s.path)
    if digest_bytes(data) != s.digest:
        return None
    with Image.open(io.BytesIO(data)) as im:  # placed while open: a JPEG is drafted before it decodes
        return placed(im, s, flip, lambda decoded: to_rgb(decoded, s.background))


def upright_image(datasets: tuple[DatasetSource, ...], s: ImageRow) -> Image.Image | None:
    """The sample's whole image, RGB (alpha on its background), turned upright as viewers show it;
    None when its bytes changed since preprocess. Raises OSError, ValueError or SyntaxError on a
    broken file."""
    data = read_image_bytes(datasets[s.source], s.path)
    if digest_bytes(data) != s.digest:
        return None
    with Image.open(io.BytesIO(data)) as im:
        turn = EXIF_TRANSPOSE.get(im.getexif().get(ExifTags.Base.Orientation, 1))
        rgb = to_rgb(im, s.background)
    return rgb.transpose(turn) if turn is not None else rgb


def decode_failure(e: OSError | ValueError | SyntaxError) -> str:
    """Why a file whose header preprocess read cannot be decoded: an I/O error, or pixel data
    that is damaged (preprocess reads headers only, so this is where damage shows)."""
    if isinstance(e, OSError) and e.errno is not None:
        return f"cannot read it ({e.strerror})"
    return f"cannot decode its pixels: the image data is damaged ({type(e).__name__}: {e})"


class ImageCrops:
    """A map-style dataset of (latent job index, pixels in [-1, 1] or None, why it failed): a broken
    file, or one whose bytes changed since preprocess, is reported, never raised."""

    def __init__(self, datasets: tuple[DatasetSource, ...], samples: list[ImageRow], flips: list[bool]):
        self.datasets, self.samples, self.flips = datasets, samples, flips

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor | None, str]:
        import torch

        s = self.samples[i]
        try:
            frames = (self._placed_clip if s.is_clip else self._placed_image)(s, self.flips[i])
        except VideoProblem as problem:
            return i, None, f"cannot decode ({problem})"
        except (OSError, ValueError, SyntaxError) as e:
            return i, None, decode_failure(e)
        if frames is None:
            return i, None, "changed since preprocess ran (run the pipeline again)"
        pixels = torch.stack([_tensor(im) for im in frames], dim=1)  # (3, F, H, W)
        if s.condition_frames:
            return i, condition_clip(pixels, s.condition_frames), ""
        return i, pixels if s.is_clip else pixels[:, 0], ""

    def _placed_image(self, s: ImageRow, flip: bool) -> list[Image.Image] | None:
        image = placed_image(self.datasets, s, flip)
        return None if image is None else [image]

    def _placed_clip(self, s: ImageRow, flip: bool) -> list[Image.Image] | None:
        return placed_clip(self.datasets, s, flip)


def placed_clip(datasets: tuple[DatasetSource, ...], s: ImageRow, flip: bool = False) -> list[Image.Image] | None:
    """A clip window's frames placed as preprocess decided; None when they changed since. Raises
    VideoProblem on a clip that cannot be decoded."""
    frames = decode_frames(local_file(datasets[s.source], s.path), list(s.frames))
    if digest_json([frame_digest(frame) for frame in frames]) != s.digest:
        return None
    return [placed(Image.fromarray(frame), s, flip, lambda decoded: decoded) for frame in frames]


def placed_still(datasets: tuple[DatasetSource, ...], s: ImageRow) -> Image.Image | None:
    """An image placed, or a clip window's first frame (what a rendered clip is compared with); None
    when it changed since preprocess."""
    if not s.is_clip:
        return placed_image(datasets, s)
    frames = placed_clip(datasets, s)
    return None if frames is None else frames[0]


def _tensor(im: Image.Image) -> torch.Tensor:
    """(3, H, W) in [-1, 1]."""
    import torch

    pixels = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8)
    return pixels.view(im.height, im.width, 3).permute(2, 0, 1).float() / 127.5 - 1.0


def condition_clip(pixels: torch.Tensor, frames: int) -> torch.Tensor:
    """An image-to-video model's conditioning image, (3, H, W) or a one-frame clip (3, 1, H, W), as the
    clip its VAE encodes (ImageCondition): the image, then zero frames up to `frames` (3, F, H, W)."""
    import torch

    image = pixels if pixels.ndim == 4 else pixels.unsqueeze(1)
    return torch.cat([image, image.new_zeros(image.shape[0], frames - 1, *image.shape[2:])], dim=1)


def sample_shape(sample: ImageRow) -> tuple[int, int, int]:
    """A preprocess sample's pixel shape as batches group it: (the frames it is encoded from, or 0 for
    an image, H, W)."""
    return (sample.encoded_frames, *sample.size)


def size_batches(sizes: list[tuple[int, ...]], batch_size: int) -> list[list[int]]:
    """Index batches of at most `batch_size`, each of one size (one VAE call per batch; a size may
    carry a leading group, which batches do not cross either). Expects indices already grouped by
    size, as the latent jobs are (sorted by size, then key)."""
    batches: list[list[int]] = []
    for i, size in enumerate(sizes):
        if batches and sizes[batches[-1][0]] == size and len(batches[-1]) < batch_size:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches
