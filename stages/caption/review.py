"""The dataset review: what a person scans before training on generated captions.

review.html and its further pages (self-contained: each image's thumbnail inlined as a data: URI,
upright and uncropped as the user sees it, with its final caption and where that came from; at
most a page of thumbnails a file, review_pages.Paging) and review.md (the same facts as
tables, no images: the Prefect markdown artifact). Both hold the preprocess rejections and
warnings, the bucket counts and a histogram of caption lengths in words. The same inputs give the
same bytes (no time, no environment; JPEG thumbnails encode deterministically).
"""
from __future__ import annotations

import base64
import io
from collections import Counter
from pathlib import Path

from PIL import Image

from lorapipe.cache.digest import digest_bytes

from ..encode.images import resized_upright
from ..preprocess.rows import SampleRow
from ..preprocess.sources import DatasetSource, local_file, read_image_bytes
from ..video import VideoProblem, decode_frames
from .review_pages import PAGE_FILES, REVIEW_HTML, Paging, Review, Row, html_pages, markdown_page, page_name

__all__ = ["PAGE_FILES", "REVIEW_HTML", "REVIEW_MD", "Paging", "collect", "length_histogram", "write_review"]

REVIEW_MD = "review.md"
THUMB_SIDE = 160  # px: the longer side of a thumbnail
THUMB_QUALITY = 80  # JPEG
LENGTH_BIN = 5  # words per bar of the caption length histogram


def write_review(out_dir: Path, samples: list[SampleRow], captions: dict, report: dict,
                 datasets: tuple[DatasetSource, ...], paging: Paging = Paging()) -> None:
    """review.html (and its further pages) and review.md in `out_dir`, from dataset.json's samples,
    captions.json's content and preprocess's report.json."""
    review = collect(samples, captions, report, datasets, paging.thumbnails)
    for page, text in enumerate(html_pages(review, paging), 1):
        (out_dir / page_name(page)).write_text(text)
    (out_dir / REVIEW_MD).write_text(markdown_page(review, paging))


def collect(samples: list[SampleRow], captions: dict, report: dict, datasets: tuple[DatasetSource, ...],
            thumbnails: int = Paging().thumbnails) -> Review:
    """The review's content; the first `thumbnails` samples with theirs (a review lists the later ones without)."""
    entries = captions.get("samples", {})
    rows = [_row(s, entries.get(s.id), datasets, i < thumbnails) for i, s in enumerate(samples)]
    buckets = Counter(row.size for row in rows)
    return Review(rows=rows, buckets=sorted(buckets.items(), key=lambda b: (_area(b[0]), b[0])),
                  lengths=length_histogram([len(row.caption.split()) for row in rows]),
                  sources=sorted(Counter(row.source for row in rows).items()),
                  rejected=report.get("rejected", []), warnings=report.get("warnings", []),
                  captioner=captions.get("captioner", {}))


def _row(sample: SampleRow, entry: dict | None, datasets: tuple[DatasetSource, ...], with_thumbnail: bool) -> Row:
    entry = entry or {"caption": sample.caption, "source": "written", "written": sample.caption,
                      "generated": None}  # a sample the caption stage did not list keeps its written caption
    thumbnail, problem = _thumbnail(sample, datasets) if with_thumbnail else ("", "")
    return Row(id=sample.id, label=sample.label(datasets), split=sample.split,
               size=f"{sample.size[1]}x{sample.size[0]}", caption=entry["caption"], source=entry["source"],
               written=entry.get("written"), generated=entry.get("generated"), thumbnail=thumbnail, problem=problem)


def _area(size: str) -> int:
    width, height = size.split("x")
    return int(width) * int(height)


def length_histogram(words: list[int]) -> list[tuple[str, int]]:
    """Captions per length: "empty" (no words: a row apart, not the shortest of the captions), then
    LENGTH_BIN-word ranges up to the longest, none left out."""
    counts = Counter(0 if n == 0 else (n - 1) // LENGTH_BIN + 1 for n in words)
    bins = [("empty", counts[0])] if counts[0] else []
    for b in range(1, max(counts, default=0) + 1):
        bins.append((f"{(b - 1) * LENGTH_BIN + 1}-{b * LENGTH_BIN}", counts[b]))
    return bins


def _thumbnail(sample: SampleRow, datasets: tuple[DatasetSource, ...]) -> tuple[str, str]:
    """(data: URI of the upright, uncropped image at most THUMB_SIDE wide and high, "") or ("", why not)."""
    height, width = sample.original_size
    scale = min(1.0, THUMB_SIDE / max(height, width))
    size = (max(1, round(height * scale)), max(1, round(width * scale)))
    source = datasets[sample.source]
    try:
        if sample.is_clip:  # a clip's window: its first frame
            frame = decode_frames(local_file(source, sample.path), list(sample.frames[:1]))[0]
            image = Image.fromarray(frame).resize(size[::-1], Image.BICUBIC)
        else:
            data = read_image_bytes(source, sample.path)
            if digest_bytes(data) != sample.digest:
                return "", "changed since preprocess ran"
            with Image.open(io.BytesIO(data)) as opened:
                image = resized_upright(opened, size, sample.background or (255, 255, 255))
    except (OSError, ValueError, SyntaxError, VideoProblem) as error:  # a line of the review, not its end
        return "", f"cannot be shown ({type(error).__name__}: {error})"
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=THUMB_QUALITY)
    return f"data:image/jpeg;base64,{base64.b64encode(buffer.getvalue()).decode()}", ""
