"""Validation without decoding pixels: file access, image header, truncation, size, duplicates.

Reading a header (format, size, mode, EXIF orientation) costs a few KB per image, so a rerun on a
changed dataset stays cheap; pixels are decoded once, by encode.
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from typing import BinaryIO

from PIL import Image, UnidentifiedImageError

from .listing import OutsideDataset
from .sources import Candidate, DatasetSource

TRANSPOSED = (5, 6, 7, 8)  # EXIF orientations that swap width and height
SHOWN_PER_REASON = 3
HEAD, TAIL = 16, 4096  # bytes read for the truncation check


@dataclass(frozen=True)
class ImageInfo:
    width: int  # after EXIF orientation
    height: int
    has_alpha: bool
    digest: str


class Rejected(Exception):
    """An input that cannot be used; `reason` is one of a few fixed words for the report."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


class Unparsable(Exception):
    """The header is not one of an image format PIL reads."""


def _header(f: BinaryIO) -> tuple[int, int, bool, str]:
    """(width, height after EXIF orientation, has alpha, format) from the header alone."""
    try:
        with Image.open(f) as im:
            width, height, fmt = im.width, im.height, im.format
            has_alpha = im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in im.info
            if _orientation(im, f) in TRANSPOSED:
                width, height = height, width
    except (UnidentifiedImageError, ValueError, SyntaxError, EOFError) as e:
        raise Unparsable(type(e).__name__) from None
    except OSError as e:  # PIL raises OSError for broken headers too; keep real I/O errors apart
        if e.errno is not None:
            raise
        raise Unparsable(type(e).__name__) from None
    return width, height, has_alpha, fmt


def _orientation(im: Image.Image, f: BinaryIO) -> int | None:
    """The EXIF orientation, pixels left undecoded: Pillow's PNG getexif() decodes the whole image
    first (to reach chunks after the pixel data), so a PNG's header chunks are read as other
    formats' headers are, and an eXIf chunk after the pixel data is found by chunk headers."""
    if im.format != "PNG":
        return im.getexif().get(0x0112)
    exif = Image.Image.getexif(im)  # what the chunks before the pixel data hold
    if 0x0112 not in exif and "exif" not in im.info and (data := _png_chunk(f, b"eXIf")) is not None:
        exif.load(data)
    return exif.get(0x0112)


def _png_chunk(f: BinaryIO, kind: bytes) -> bytes | None:
    """The data of a PNG's first `kind` chunk, walking chunk headers and seeking past the rest."""
    f.seek(8)  # the signature
    while len(header := f.read(8)) == 8 and header[4:] != b"IEND":
        length = int.from_bytes(header[:4], "big")
        if header[4:] == kind:
            return f.read(length)
        f.seek(length + 4, io.SEEK_CUR)  # the data and its CRC
    return None


def inspect_image(candidate: Candidate, min_side: int) -> ImageInfo:
    """Header facts of one image, or Rejected naming why it cannot be used."""
    try:
        with candidate.open() as f:
            size = f.seek(0, io.SEEK_END)
            f.seek(max(0, size - TAIL))
            tail = f.read()
            f.seek(0)
            head = f.read(HEAD)
            f.seek(0)
            if size:
                width, height, has_alpha, fmt = _header(f)
    except OSError as e:
        raise Rejected("unreadable", f"cannot read the file ({e.strerror or type(e).__name__})") from None
    except OutsideDataset as e:
        raise Rejected("outside_dataset", str(e)) from None
    except Unparsable as e:
        raise Rejected("not_an_image", f"not a readable image ({e})") from None
    if not size:
        raise Rejected("empty_file", "zero bytes")
    if truncated(head, tail, size, fmt):
        raise Rejected("truncated", f"the {fmt} data ends early (a partial download or copy?)")
    if min(width, height) < min_side:
        raise Rejected("too_small", f"{width}x{height} is below preprocess.min_side {min_side}")
    return ImageInfo(width, height, has_alpha, candidate.digest())


def mask_entry(candidate: Candidate, info: ImageInfo, source: DatasetSource) -> dict | None:
    """What the sample's loss mask is made from (dataset.json's `mask`), or None (weight 1): a
    sidecar must be a readable image of the image's size as shown (after EXIF orientation)."""
    if source.mask == "alpha" and info.has_alpha:
        return {"from": "alpha"}
    if candidate.mask is None:
        return None
    try:
        with candidate.mask.open() as f:
            width, height, _, _ = _header(f)
    except (OSError, Unparsable) as e:
        raise Rejected("bad_mask", f"its mask {candidate.mask.rel} is not a readable image ({e})") from None
    if (width, height) != (info.width, info.height):
        raise Rejected("bad_mask", f"its mask {candidate.mask.rel} is {width}x{height}, the image {info.width}x"
                       f"{info.height}: a mask must have its image's size (or set mask: none on the dataset)")
    return {"from": "sidecar", "path": candidate.mask.rel, "digest": candidate.mask.digest()}


def truncated(head: bytes, tail: bytes, size: int, fmt: str | None) -> bool:
    """Whether the file stops before its format's end marker (cheap: looks at head and tail only)."""
    if fmt in ("JPEG", "MPO"):
        return b"\xff\xd9" not in tail  # entropy-coded data never holds FF D9 (FF is stuffed)
    if fmt == "PNG":
        return b"IEND" not in tail[-64:]
    if fmt == "WEBP":
        return int.from_bytes(head[4:8], "little") + 8 > size  # the RIFF header's length
    return False


def summary_lines(entries: list[dict], verb: str) -> list[str]:
    """Per reason: the count and the first few file names ("preprocess: rejected 2 duplicate: ...")."""
    by_reason: dict[str, list[str]] = {}
    for r in entries:
        by_reason.setdefault(r["reason"], []).append(r["path"])
    lines = []
    for reason, paths in sorted(by_reason.items()):
        more = f" and {len(paths) - SHOWN_PER_REASON} more" if len(paths) > SHOWN_PER_REASON else ""
        lines.append(f"preprocess: {verb} {len(paths)} {reason}: {', '.join(paths[:SHOWN_PER_REASON])}{more}")
    return lines


def findings_markdown(report: dict) -> list[str]:
    """A "Dataset" section for a markdown report: every file preprocess rejected and every warning
    (its report.json's rows), each with its reason and detail."""
    lines = ["## Dataset", ""]
    for title, entries in (("Rejected", report.get("rejected", [])), ("Warnings", report.get("warnings", []))):
        lines += [f"{title}: {len(entries) or 'none'}", ""]
        lines += [f"- `{e['path']}`: {e['reason']}" + (f" ({' '.join(e['detail'].split())})" if e.get("detail") else "")
                  for e in entries]
        lines += [""] if entries else []
    return lines
