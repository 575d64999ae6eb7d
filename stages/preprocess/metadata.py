"""Captions from metadata.jsonl / metadata.csv files (the diffusers imagefolder convention:
`file_name` relative to the metadata file, a caption column), row by row.

A row that cannot be used is a RowProblem, never silently dropped: `bad_row` (a malformed line,
no file name, not UTF-8), `outside_dataset` (`../` or an absolute path, or through a link to
outside), `listed_but_missing` (no such image in the dataset), `duplicate_row` (the file is
listed again: the first row wins), `bad_caption_range` (a clip's `captions` time ranges:
stages/preprocess/timed_captions.py). The rest of the dataset is used.
"""
from __future__ import annotations

import csv
import io
import json
import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..video import VIDEO_SUFFIXES
from .listing import Listing
from .timed_captions import BAD_RANGE, TIMED_CAPTIONS_KEY, BadRanges, TimedCaptions, timed_captions

METADATA_FILES = ("metadata.jsonl", "metadata.csv")


@dataclass(frozen=True)
class RowProblem:
    file: str  # the metadata file, relative to the dataset folder
    line: int | None  # None: the whole file
    reason: str
    detail: str

    @property
    def where(self) -> str:
        return self.file if self.line is None else f"{self.file}:{self.line}"


@dataclass(frozen=True)
class MetadataCaption:
    text: str | None  # None: the row has no value in the caption column
    where: str  # "metadata.jsonl:3"
    file: str = ""  # the metadata file, relative to the dataset folder
    row: dict | None = None  # the whole row (its reference columns: stages/preprocess/references.py)
    timed: TimedCaptions | None = None  # a clip's captions per time range; None: the row gives none


def metadata_captions(listing: Listing, offered: set[str], column: str
                      ) -> tuple[dict[str, MetadataCaption], list[RowProblem]]:
    """Per image (by relative path) the caption its first row gives, and every row problem.
    `offered`: the relative paths of the image files the dataset offers."""
    captions: dict[str, MetadataCaption] = {}
    problems = []
    for meta in (rel for rel in listing.files if posixpath.basename(rel) in METADATA_FILES):
        try:
            rows = list(_rows(listing.files[meta]))
        except OSError as e:
            problems.append(RowProblem(meta, None, "unreadable", f"cannot read it ({e.strerror})"))
            continue
        for line, row in rows:
            where = f"{meta}:{line}"
            name = row.get("file_name") if isinstance(row, dict) else None
            if not isinstance(row, dict) or not isinstance(name, str) or not name.strip():
                problems.append(RowProblem(meta, line, "bad_row", row if isinstance(row, str) else "no file_name"))
                continue
            rel = posixpath.normpath(posixpath.join(posixpath.dirname(meta), name))
            reason, detail = _target_problem(rel, name, listing, offered)
            if not reason and rel in captions:
                reason, detail = "duplicate_row", f"{rel} is listed again: the row at {captions[rel].where} is used"
            if reason:
                problems.append(RowProblem(meta, line, reason, detail))
                continue
            try:
                timed = _timed_captions(row, rel, column, where)
            except BadRanges as e:
                problems.append(RowProblem(meta, line, BAD_RANGE, str(e)))
                continue
            caption = row.get(column)
            captions[rel] = MetadataCaption(None if caption is None else str(caption), where, meta, row, timed)
    return captions, problems


def _timed_captions(row: dict, rel: str, column: str, where: str) -> TimedCaptions | None:
    """The row's time-ranged captions for the clip `rel` names (None: it gives none)."""
    if not rel.lower().endswith(VIDEO_SUFFIXES):  # an image's row is read as before, whatever its columns
        return None
    timed = timed_captions(row.get(TIMED_CAPTIONS_KEY), where)
    if timed and str(row.get(column) or "").strip():
        raise BadRanges(f"both {column!r} and {TIMED_CAPTIONS_KEY} are set: a clip's windows take the captions of"
                        " their ranges; remove one")
    return timed


def _target_problem(rel: str, name: str, listing: Listing, offered: set[str]) -> tuple[str, str]:
    """("", "") when the row names an image the dataset offers, else (reason, detail)."""
    if rel in offered:
        return "", ""
    if rel == ".." or rel.startswith(("../", "/")):
        return "outside_dataset", f"file_name {name!r} is outside the dataset folder"
    parts = rel.split("/")
    link = next((folder for folder in ("/".join(parts[:n]) for n in range(1, len(parts)))
                 if folder in listing.skipped), None)
    if link and listing.skipped[link].reason == "outside_dataset":
        return "outside_dataset", f"file_name {name!r} is reached through {link}, a link to outside the dataset"
    return "listed_but_missing", f"file_name {name!r}: no such image in the dataset"


def _rows(path: Path) -> Iterator[tuple[int, dict | str]]:
    """(line number, the row, or why it is malformed) for each non-blank row."""
    text = path.read_bytes().decode("utf-8-sig", "surrogateescape")  # undecodable bytes: that row only
    rows = _csv_rows(text) if path.suffix == ".csv" else _jsonl_rows(text)
    for line, row in rows:
        try:
            json.dumps(row, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            row = "not UTF-8 text"
        yield line, row


def _jsonl_rows(text: str) -> Iterator[tuple[int, dict | str]]:
    for line, row in enumerate(text.split("\n"), 1):  # not splitlines: JSON strings may hold U+2028
        if row.strip():
            try:
                value = json.loads(row)
            except ValueError as e:
                yield line, f"not a JSON object ({e})"
                continue
            yield line, value if isinstance(value, dict) else "not a JSON object"


def _csv_rows(text: str) -> Iterator[tuple[int, dict | str]]:
    reader = csv.DictReader(io.StringIO(text, newline=""))
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            yield reader.reader.line_num, f"not a CSV row ({e})"
            continue
        yield reader.line_num, row
