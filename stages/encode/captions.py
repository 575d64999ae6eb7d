"""Caption augmentation with cached text embeddings: K variant captions per training sample, each
encoded as an ordinary text record; the batch plan (stages/train/data.py) picks one per draw.

A caption is read as comma-separated tags (kohya's convention). Variant v of a sample keeps its
first `keep_tokens` tags in place, drops each other tag with probability `tag_dropout` and, with
`shuffle_tags`, puts the remaining ones in a random order. Every random choice is a hash of the
image's content digest, v and what is drawn (lorapipe.stages.contract.derived_seed): the same on a rerun, in
every process and on every machine, and unchanged by a rename or a new VAE, so neither re-encodes
text. A variant's record is keyed by its text, like any caption's, so identical variants (of one
sample or of two) share one record. Held-out samples keep their caption as written (they are
scored, never trained on). Caption dropout is a train setting: a draw takes the cached empty prompt.
"""
from __future__ import annotations

from typing import Iterator

from pydantic import Field, model_validator

from ..contract import Frozen, derived_seed

MAX_CAPTION_VARIANTS = 64


class CaptionAugmentation(Frozen):
    """encode's caption settings. Each is left out of every dump (so of encode's key) while at its
    default: a config without them keeps the keys, and the cache, it had before they existed."""

    caption_variants: int = Field(1, ge=1, le=MAX_CAPTION_VARIANTS, exclude_if=lambda v: v == 1,
                                  description="augmented captions encoded per training sample; 1: the caption as"
                                  " written (shuffle_tags and tag_dropout need 2 or more). At most"
                                  f" {MAX_CAPTION_VARIANTS}: each variant is one more text record per training"
                                  " image to encode and store, and training draws one per epoch, so beyond a few"
                                  " dozen most are never seen (kohya-style trainers use a handful)")
    shuffle_tags: bool = Field(False, exclude_if=lambda v: not v,
                               description="each variant lists the caption's comma-separated tags in its own order")
    keep_tokens: int = Field(0, ge=0, exclude_if=lambda v: v == 0,
                             description="the first N tags stay first, in place, and are never dropped")
    tag_dropout: float = Field(0.0, ge=0, lt=1, exclude_if=lambda v: v == 0,
                               description="each variant drops each other tag with this probability")

    @model_validator(mode="after")
    def _check(self) -> "CaptionAugmentation":
        augmented = self.shuffle_tags or self.tag_dropout > 0
        if self.caption_variants > 1 and not augmented:
            raise ValueError(f"caption_variants: {self.caption_variants} would be identical captions: set shuffle_tags"
                             " or tag_dropout, or leave caption_variants at 1")
        if augmented and self.caption_variants == 1:
            raise ValueError("shuffle_tags / tag_dropout: set caption_variants to how many augmented captions each"
                             " training sample gets (e.g. 4); with 1, its one caption would be the same every epoch")
        if self.keep_tokens and not augmented:
            raise ValueError("keep_tokens keeps the first tags in place under shuffle_tags or tag_dropout: set one"
                             " of them, or remove keep_tokens")
        return self

    def captions(self, caption: str, image_digest: str) -> Iterator[str]:
        """A training sample's captions, one at a time: as written when caption_variants is 1, else
        its variants."""
        if self.caption_variants == 1:
            yield caption
            return
        tags = [tag for tag in (t.strip() for t in caption.split(",")) if tag]
        for v in range(self.caption_variants):
            yield self._variant(tags, image_digest, v)

    def _variant(self, tags: list[str], image_digest: str, v: int) -> str:
        kept = tags[:self.keep_tokens]
        rest = [(i, tag) for i, tag in enumerate(tags[self.keep_tokens:])
                if _uniform(image_digest, v, "drop", i) >= self.tag_dropout]
        if self.shuffle_tags:
            rest.sort(key=lambda item: _uniform(image_digest, v, "order", item[0]))
        return ", ".join([*kept, *(tag for _, tag in rest)])


def _uniform(*parts: object) -> float:
    """A number in [0, 1) that depends on `parts` alone."""
    return derived_seed("caption", *parts) / 2**63
