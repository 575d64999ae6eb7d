"""Edit pairs' reference images as images to encode: each a latent record of its own, keyed like any
image's (its bytes, resize, crop, flip, VAE), so a reference shared by many targets is encoded once
and a target's caption edit encodes no reference."""
from __future__ import annotations

from ..preprocess.rows import ImageRow, SampleRow


def reference_id(sample_id: str, k: int) -> str:
    """The k-th reference of a sample, as the encode jobs and failures name it."""
    return f"{sample_id}>reference{k}"


def reference_images(dataset: list[SampleRow]) -> list[ImageRow]:
    """Every sample's references (SampleRow.references) as images to encode, after the samples in
    encode's index space, each in its target's size."""
    return [ImageRow(**dict(ref), id=reference_id(s.id, k), source=s.source, size=s.size)
            for s in dataset for k, ref in enumerate(s.references or ())]


def with_references(dataset: list[SampleRow]) -> list[ImageRow]:
    """The samples, then their references: what latent jobs index."""
    return dataset + reference_images(dataset)
