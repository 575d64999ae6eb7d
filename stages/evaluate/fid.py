"""FID and KID of the rendered images against a folder of reference images.

Both need Inception-v3 weights on local disk (`inception_weights`, the torch-fidelity
`pt_inception-2015-12-05` file) and torchmetrics with torch-fidelity installed. Without either,
the metric is reported as skipped with the reason: never a crash, never a made-up number.
These machines have neither, so tests exercise the skip paths only.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from PIL import Image

from lorapipe.stages.preprocess.listing import listed_files
from lorapipe.stages.preprocess.sources import IMAGE_SUFFIXES

def reference_images(folder: str) -> list[Path]:
    return [p for p in listed_files(Path(folder)) if p.suffix.lower() in IMAGE_SUFFIXES]


def why_not(reference: str | None, weights: str | None) -> str:
    """The reason FID/KID cannot be computed, or "" when they can."""
    if reference is None:
        return "no fid_reference configured"
    if not Path(reference).is_dir() or not reference_images(reference):
        return f"fid_reference {reference} is not a folder of images"
    if weights is None or not Path(weights).is_file():
        return "no local Inception weights (set inception_weights to the pt_inception-2015-12-05 file)"
    try:
        import torch_fidelity  # noqa: F401
        import torchmetrics  # noqa: F401
    except ImportError as e:
        return f"FID/KID need torchmetrics and torch-fidelity ({e.name} is not installed)"
    return ""


def fid_kid(reference: str | None, weights: str | None, columns: dict[str, list[Image.Image]]) -> dict[str, Any]:
    """{"fid": {column: value}, "kid": {column: value}} or {"skipped": reason}."""
    reason = why_not(reference, weights)
    if reason:
        return {"skipped": reason}
    import numpy as np
    import torch
    from torchmetrics.image.fid import FrechetInceptionDistance, NoTrainInceptionV3
    from torchmetrics.image.kid import KernelInceptionDistance

    def batch(images: list[Image.Image]) -> torch.Tensor:
        arrays = [np.asarray(im.convert("RGB").resize((299, 299), Image.BICUBIC)) for im in images]
        return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2)

    real = batch([Image.open(p) for p in reference_images(reference)])
    result: dict[str, Any] = {"fid": {}, "kid": {}, "n_reference": len(real)}
    for label, images in columns.items():
        extractor = NoTrainInceptionV3("inception-v3-compat", ["2048"], feature_extractor_weights_path=weights)
        fid = FrechetInceptionDistance(feature=extractor)
        kid = KernelInceptionDistance(feature=extractor, subset_size=min(len(real), len(images)))
        fake = batch(images)
        for metric in (fid, kid):
            metric.update(real, real=True)
            metric.update(fake, real=False)
        result["fid"][label] = float(fid.compute())
        result["kid"][label] = float(kid.compute()[0])
    return result
