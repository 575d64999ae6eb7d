"""Edit pairs' reference images as images to encode: each a latent record of its own, keyed like any
image's (its bytes, resize, crop, flip, VAE), so a reference shared by many targets is encoded once
and a target's caption edit encodes no reference."""
from __future__ import annotations


def reference_id(sample_id: str, k: int) -> str:
    """The k-th reference of a sample, as the encode jobs and failures name it."""
    return f"{sample_id}>reference{k}"


def reference_images(dataset: list[dict]) -> list[dict]:
    """Every sample's references (preprocess: `references`) as images to encode, after the samples
    in encode's index space: each has the fields an image sample's latent key and decoding read."""
    return [{**ref, "id": reference_id(s["id"], k), "source": s["source"], "size": s["size"], "reference_of": s["id"]}
            for s in dataset for k, ref in enumerate(s.get("references", ()))]


def with_references(dataset: list[dict]) -> list[dict]:
    """The samples, then their references: what latent jobs index."""
    return dataset + reference_images(dataset)
