"""Where images and captions come from: one or more datasets, each listed as candidates.

Formats: `folder` (nested image files with caption sidecars, and/or `metadata.jsonl` /
`metadata.csv` files in the diffusers imagefolder convention, `file_name` relative to the
metadata file), `hf` (a `datasets.save_to_disk` folder) and `parquet` (a folder of parquet
files); the last two need the `datasets` package.
"""
from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import BinaryIO, Callable, Literal

from pydantic import Field

from cache.digest import StatCache, digest_bytes, digest_json

from ..contract import Frozen

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")
METADATA_FILES = ("metadata.jsonl", "metadata.csv")
MissingCaption = Literal["error", "skip", "filename", "empty"]


class DatasetSource(Frozen):
    """One dataset of the `data:` section. Caption settings left unset use the preprocess section's."""

    path: Path = Field(description="the dataset folder")
    name: str | None = Field(None, pattern=r"^[\w.-]+$", description="prefixes sample ids when there are"
                             " several datasets; default: the folder's name")
    format: Literal["folder", "hf", "parquet"] = "folder"
    repeats: int = Field(1, ge=1, description="how many times an epoch shows each sample (kohya style)")
    caption_ext: str | None = Field(None, pattern=r"^\.\w+$", description="caption sidecar suffix")
    caption_column: str = Field("text", description="caption column of metadata files / hf / parquet")
    image_column: str = Field("image", description="image column of hf / parquet datasets")
    missing_caption: MissingCaption | None = None
    split: Literal["auto", "train", "holdout"] = Field("auto", description="holdout: a separate validation"
                                                        " set; auto: preprocess.holdout_fraction decides")

    @property
    def label(self) -> str:
        return self.name or self.path.name


@dataclass(frozen=True)
class Candidate:
    """One image a dataset offers, before validation."""

    source: int  # index of its dataset in the config's list
    rel: str  # path relative to the dataset folder; "row-N" for hf / parquet rows
    label: str  # what the user sees: rel, prefixed by the dataset name when there are several
    caption: str | None  # None: no caption found
    caption_problem: str  # why there is no caption (when caption is None)
    open: Callable[[], BinaryIO]  # the image file, opened for reading (OSError when unreadable)
    digest: Callable[[], str]  # content digest of those bytes (stat-cached for files)


def caption_ext(source: DatasetSource, default: str) -> str:
    return source.caption_ext or default


def listed_files(root: Path) -> list[Path]:
    """Every file (or symlink, possibly dangling) under `root`, sorted, hidden folders skipped."""
    if not root.is_dir():
        raise FileNotFoundError(f"dataset folder {root} does not exist")
    found = []  # os.walk on strings: pathlib's rglob + relative_to cost ~100 us a file at 10k files
    for folder, dirs, names in os.walk(root, followlinks=True):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        rel = os.path.relpath(folder, root)
        prefix = () if rel == "." else tuple(rel.split(os.sep))
        found += [(*prefix, name) for name in names if not name.startswith(".")]
    return [root.joinpath(*parts) for parts in sorted(found)]


def _file_digest(path: Path, stat_cache: StatCache) -> str:
    """Its content digest; an unreadable file gets a marker that changes when it is fixed."""
    try:
        return stat_cache.digest(path)
    except OSError:
        st = path.lstat()
        return f"unreadable:{st.st_mode:o}:{st.st_size}:{st.st_mtime_ns}"


def fingerprint(source: DatasetSource, default_caption_ext: str, stat_cache: StatCache) -> str:
    """Relative paths and content digests of every file the dataset's samples come from."""
    root = source.path
    if source.format == "folder":
        wanted = {*IMAGE_SUFFIXES, caption_ext(source, default_caption_ext)}
        files = [p for p in listed_files(root) if p.suffix.lower() in wanted or p.name in METADATA_FILES]
    else:
        files = listed_files(root)
    return digest_json([[p.relative_to(root).as_posix(), _file_digest(p, stat_cache)] for p in files])


def candidates(source: DatasetSource, index: int, prefix: str, default_caption_ext: str,
               stat_cache: StatCache) -> list[Candidate]:
    if source.format != "folder":
        return _table_candidates(source, index, prefix)
    root, ext = source.path, caption_ext(source, default_caption_ext)
    files = listed_files(root)
    metadata = _metadata_captions(root, files, source.caption_column)
    found = []
    for path in (p for p in files if p.suffix.lower() in IMAGE_SUFFIXES):
        rel = path.relative_to(root).as_posix()
        caption, problem = metadata.get(rel), ""
        if caption is None:
            caption, problem = _sidecar(path.with_suffix(ext))
        found.append(Candidate(index, rel, prefix + rel, caption, problem, lambda path=path: open(path, "rb"),
                               lambda path=path: stat_cache.digest(path)))
    return found


def _sidecar(path: Path) -> tuple[str | None, str]:
    if not path.is_file():
        return None, f"no {path.suffix} sidecar or metadata entry"
    try:
        return path.read_text(encoding="utf-8", errors="replace"), ""
    except OSError as e:
        return None, f"caption file {path.name} is unreadable ({e.strerror})"


def _metadata_captions(root: Path, files: list[Path], column: str) -> dict[str, str]:
    """Captions from every metadata.jsonl / metadata.csv, by image path relative to `root`."""
    captions = {}
    for path in (p for p in files if p.name in METADATA_FILES):
        base = path.parent.relative_to(root).as_posix()
        for where, row in _metadata_rows(path):
            if "file_name" not in row or column not in row:
                raise ValueError(f"{where}: needs the columns file_name and {column} (preprocess caption_column)")
            rel = row["file_name"] if base == "." else f"{base}/{row['file_name']}"
            captions[rel] = str(row[column])
    return captions


def _metadata_rows(path: Path):
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".csv":
        for n, row in enumerate(csv.DictReader(io.StringIO(text)), 2):
            yield f"{path}:{n}", row
        return
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not a JSON object ({e})") from None
            yield f"{path}:{n}", row if isinstance(row, dict) else {}


def _table_candidates(source: DatasetSource, index: int, prefix: str) -> list[Candidate]:
    table = load_table(source.path, source.format, source.image_column)
    for column in (source.image_column, source.caption_column):
        if column not in table.column_names:
            raise ValueError(f"{source.path}: no column {column!r} (columns: {', '.join(table.column_names)})")
    found = []
    for row, caption in enumerate(table[source.caption_column]):
        read = lambda row=row: row_image_bytes(source.path, source.format, source.image_column, row)  # noqa: E731
        text = None if caption is None else str(caption)
        found.append(Candidate(index, f"row-{row}", f"{prefix}row-{row}", text, "no caption in this row",
                               lambda read=read: io.BytesIO(read()), lambda read=read: digest_bytes(read())))
    return found


@lru_cache(maxsize=8)  # one open table per dataset and process, shared by the decode threads (read-only)
def load_table(path: Path, fmt: str, image_column: str):
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{path}: format {fmt} needs the `datasets` package (pip install datasets)") from None
    if fmt == "hf":
        table = datasets.load_from_disk(str(path))
    else:
        files = sorted(str(p) for p in Path(path).rglob("*.parquet"))
        if not files:
            raise FileNotFoundError(f"{path}: no .parquet files")
        table = datasets.load_dataset("parquet", data_files=files, split="train")
    if isinstance(table, datasets.DatasetDict):
        raise ValueError(f"{path}: holds several splits ({', '.join(table)}); point data.path at one")
    if image_column in table.column_names:
        table = table.cast_column(image_column, datasets.Image(decode=False))
    return table


def row_image_bytes(path: Path, fmt: str, image_column: str, row: int) -> bytes:
    value = load_table(path, fmt, image_column)[row][image_column]
    if value.get("bytes") is None:
        return Path(value["path"]).read_bytes()
    return value["bytes"]


def read_image_bytes(source: DatasetSource, rel: str) -> bytes:
    """The bytes of a sample's image (what encode decodes)."""
    if source.format == "folder":
        return (source.path / rel).read_bytes()
    return row_image_bytes(source.path, source.format, source.image_column, int(rel.removeprefix("row-")))
