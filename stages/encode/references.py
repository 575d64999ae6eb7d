"""Edit pairs' reference images as images to encode: each a latent record of its own, keyed like any
image's (its bytes, resize, crop, flip, VAE), so a reference shared by many targets is encoded once
and a target's caption edit encodes no reference. An image-to-video model's conditioning image is a
clip window's reference, encoded as its family says (ImageCondition: the image alone, or the first
frame of a clip of the window's length): that length is in its key."""
from __future__ import annotations

from ..families.base import ImageCondition
from ..preprocess.rows import ImageRow, SampleRow


def reference_id(sample_id: str, k: int) -> str:
    """The k-th reference of a sample, as the encode jobs and failures name it."""
    return f"{sample_id}>reference{k}"


def reference_images(dataset: list[SampleRow], condition: ImageCondition | None = None) -> list[ImageRow]:
    """Every sample's references (SampleRow.references) as images to encode, after the samples in
    encode's index space, each in its target's size (a model's conditioning images as it encodes them)."""
    return [ImageRow(**dict(ref), id=reference_id(s.id, k), source=s.source, size=s.size,
                     condition_frames=condition_frames(s, condition))
            for s in dataset for k, ref in enumerate(s.references or ())]


def condition_frames(sample: SampleRow, condition: ImageCondition | None) -> int | None:
    """The frames the sample's conditioning image is encoded as (None: a model without one)."""
    if condition is None:
        return None
    return max(sample.frame_count, 1) if condition.padded else 1


def with_references(dataset: list[SampleRow], condition: ImageCondition | None = None) -> list[ImageRow]:
    """The samples, then their references: what latent jobs index."""
    return dataset + reference_images(dataset, condition)
