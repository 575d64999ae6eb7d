"""Loss-mask records: a masked sample's mask placed exactly as its image, at latent resolution.

Preprocess names what a sample's mask is made from (dataset.json's `mask`): a sidecar file, or the
image's own alpha channel. Here it is decoded as gray levels, turned upright, resized and cropped
as the image is (mirrored for the mirrored latent), then averaged over each latent pixel's
`factor` x `factor` image pixels (the VAE's downsampling): weights in [0, 1], white 1.

Record: "mask" (1, h, w) float32 at the latent record's h and w.
Key: the mask's bytes (for alpha: the image's), the resize, crop box, flip, the factor and
MASK_VERSION; neither the image's latent nor its caption, so an edited mask re-encodes its own
record and nothing else, and adding masks to a dataset keeps its latent and text records.
"""
from __future__ import annotations

import io
from typing import TYPE_CHECKING, Callable

from PIL import Image

from lorapipe.cache.digest import digest_bytes, digest_json

from ..encoded import encode_record
from ..preprocess.rows import SampleRow
from ..preprocess.sources import DatasetSource, read_image_bytes
from .images import placed, to_rgb

if TYPE_CHECKING:
    import torch

MASK_VERSION = "1"


def mask_key(sample: SampleRow, factor: int, flip: bool = False) -> str | None:
    """The sample's mask record key; None when it has no mask."""
    mask = sample.mask
    if mask is None:
        return None
    made_from = {"sidecar": mask.digest} if mask.made_from == "sidecar" else {"alpha": sample.digest}
    return digest_json({**made_from, "resized": list(sample.resized), "crop_box": list(sample.crop_box), "flip": flip,
                        "factor": factor, "version": MASK_VERSION})[:40]


def mask_weights(sample: SampleRow, datasets: tuple[DatasetSource, ...], factor: int, flip: bool) -> torch.Tensor:
    """(1, h, w) weights in [0, 1]; OSError or ValueError when the file cannot be used."""
    import numpy as np
    import torch

    mask, source = sample.mask, datasets[sample.source]
    path, digest = (mask.path, mask.digest) if mask.made_from == "sidecar" else (sample.path, sample.digest)
    data = read_image_bytes(source, path)
    if digest_bytes(data) != digest:
        raise ValueError(f"{path} changed since preprocess ran (run the pipeline again)")
    gray: Callable[[Image.Image], Image.Image] = (
        (lambda im: to_rgb(im, None).convert("L")) if mask.made_from == "sidecar"
        else (lambda im: im.convert("RGBA").getchannel("A")))
    with Image.open(io.BytesIO(data)) as im:
        im = placed(im, sample, flip, gray)
    latent_size = (im.width // factor, im.height // factor)
    averaged = im.convert("F").resize(latent_size, Image.BOX)  # each latent pixel: the mean of its pixels
    return torch.from_numpy(np.asarray(averaged, dtype=np.float32) / 255).unsqueeze(0)


def encode_masks(jobs: list[tuple[str, SampleRow, bool]], datasets: tuple[DatasetSource, ...], factor: int,
                 add: Callable[[str, dict[str, bytes]], None], log: Callable[[str], None]) -> dict[str, str]:
    """jobs: (mask record key, preprocess sample, flipped). Returns the samples whose mask could not
    be read: id -> reason (they are left out, as an undecodable image is)."""
    failed: dict[str, str] = {}
    for key, sample, flip in jobs:
        try:
            weights = mask_weights(sample, datasets, factor, flip)
        except (OSError, ValueError, SyntaxError) as e:
            failed[sample.id] = f"its mask cannot be used ({type(e).__name__}: {e})"
            log(f"encode: skipped {sample.label(datasets)}: {failed[sample.id]}")
            continue
        add(key, encode_record({"mask": weights}, {"from": sample.mask.made_from, "flip": flip}))
    return failed
