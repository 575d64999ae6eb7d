"""A dataset's caption_policy: which images get a generated caption, and each image's final caption.

A caption written by the user is read, never modified on disk: the policy decides what training sees.
"""
from __future__ import annotations

from ..preprocess.rows import SampleRow
from ..preprocess.sources import DatasetSource


def written_caption(sample: SampleRow) -> str | None:
    """The caption the user wrote (None: preprocess found none and left it to the caption stage)."""
    return None if sample.written is False else sample.caption


def needs_generated(sample: SampleRow, source: DatasetSource) -> bool:
    """Whether the sample's final caption takes a generated one."""
    return source.caption_policy != "fill_missing" or written_caption(sample) is None


def final_caption(written: str | None, generated: str | None, source: DatasetSource) -> tuple[str, str]:
    """(the caption training sees, where it came from: written, generated, replace, prefix, suffix or combine)."""
    policy = source.caption_policy
    if generated is None:
        return written, "written"
    if policy == "prefix":
        return f"{source.caption_text}, {generated}", "prefix"
    if policy == "suffix":
        return f"{generated}, {source.caption_text}", "suffix"
    if policy == "combine" and written is not None:
        return f"{written}. {generated}", "combine"
    if policy == "replace":
        return generated, "replace"
    return generated, "generated"
