"""Where images, clips and captions come from: one or more datasets, each listed as candidates.

Formats: `folder` (nested image files with caption sidecars, and/or `metadata.jsonl` /
`metadata.csv` files in the diffusers imagefolder convention, `file_name` relative to the
metadata file: stages/preprocess/metadata.py), `hf` (a `datasets.save_to_disk` folder) and
`parquet` (a folder of parquet files); the last two need the `datasets` package. A local folder
dataset may hold video files beside its images (stages/video.py): each is a clip candidate, known by
its decoded frames (read once per file version into the stat cache).

Nothing outside a dataset's folder is read, not even to hash it for the key: links leading
outside are refused (`outside_dataset`) unless the dataset sets `follow_symlinks`.

A folder dataset may be on object storage (`path: s3://bucket/prefix`, listing.py): its files are
known by URL, size and ETag, so an unchanged object is never downloaded again to be hashed.
"""
from __future__ import annotations

import io
import json
import os
import posixpath
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import BinaryIO, Callable, Literal

from pydantic import Field, field_validator, model_validator

from lorapipe.cache.digest import StatCache, digest_bytes, digest_json
from lorapipe.cache.objects import ObjectFile, is_url, join, read_url

from ..contract import Frozen, PathOrUrl, location_name
from ..video import VIDEO_SUFFIXES, ClipInfo, read_clip
from .listing import Listing, list_folder, named_inside, within
from .metadata import METADATA_FILES, MetadataCaption, RowProblem, metadata_captions
from .references import (ReferenceNames, column_references, control_reference, control_stems, in_control_dir,
                         target_references)
from .timed_captions import TimedCaptions

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")
# the stat cache's name for a clip's frame times and digests (stages/video.py); 2: a clip that
# decodes short of its container's duration is truncated, not a record
CLIP_RECORD = "clip-frames-2"
MASK_SUFFIX = ".mask.png"  # <image stem>.mask.png: that image's loss mask, never an image itself
DEFAULT_CAPTION_EXTS = (".txt", ".caption")  # caption_ext unset: kohya's .caption where no .txt exists
MissingCaption = Literal["error", "skip", "filename", "empty", "generate"]
CaptionPolicy = Literal["fill_missing", "replace", "prefix", "suffix", "combine"]
BadRow = Literal["skip", "error"]
SKIPPED_DETAIL = {
    "outside_dataset": "a link to outside the dataset folder, not read (follow_symlinks: true on the dataset uses it)",
    "symlink_loop": "a linked folder leading back to a folder above it, not walked",
    "unreadable": "a folder that cannot be listed",
}


class DatasetSource(Frozen):
    """One dataset of the `data:` section. Caption and row settings left unset use the preprocess section's."""

    path: PathOrUrl = Field(description="the dataset folder (or, for the folder format, an s3:// URL)")
    name: str | None = Field(None, pattern=r"^[\w.-]+$", description="prefixes sample ids when there are"
                             " several datasets; default: the folder's name")
    format: Literal["folder", "hf", "parquet"] = Field(
        "folder", description="folder: image files with caption sidecars or metadata.jsonl/.csv rows; hf: a"
        " datasets.save_to_disk folder; parquet: *.parquet files (hf and parquet need `pip install datasets`)")
    repeats: int = Field(1, ge=1, description="how many times an epoch shows each sample (kohya style)")
    caption_ext: str | None = Field(None, pattern=r"^\.\w+$", description="the caption sidecar's suffix, exactly;"
                                    " unset: preprocess.caption_ext")
    caption_column: str = Field("text", description="caption column of metadata files / hf / parquet")
    image_column: str = Field("image", description="image column of hf / parquet datasets")
    missing_caption: MissingCaption | None = Field(
        None, description="an image without a caption: error (stop the run), skip (listed in report.json),"
        " filename (its file name, underscores as spaces), empty, or generate (the caption stage writes one: needs a"
        " `caption:` section, which makes it the default); unset: preprocess.missing_caption")
    on_bad_row: BadRow | None = Field(None, description="a metadata row that cannot be used: skip (listed in"
                                      " report.json) or error (stop); unset: preprocess.on_bad_row")
    follow_symlinks: bool = Field(False, description="use links to files and folders outside the dataset folder")
    split: Literal["auto", "train", "holdout"] = Field("auto", description="holdout: a separate validation"
                                                        " set; train: none of it held out; auto:"
                                                        " preprocess.holdout_fraction decides")
    mask: Literal["sidecar", "alpha", "none"] = Field(  # at its default out of the preprocess key
        "sidecar", exclude_if=lambda v: v == "sidecar", description="per-pixel training loss weights (white 1, black"
        " 0): sidecar: `<image stem>.mask.png` where one exists; alpha: the image's alpha channel where it has"
        " one; none: no masks. An image without a mask is weighted 1 everywhere")
    role: Literal["train", "prior"] = Field(  # at its default out of the preprocess key
        "train", exclude_if=lambda v: v == "train", description="train: the subject; prior: regularisation"
        " images of its class (DreamBooth prior preservation): trained on with train.prior_loss_weight (and"
        " train.prior_target), never held out for evaluation")

    caption_policy: CaptionPolicy = Field(  # never in the preprocess key: the caption stage's
        "fill_missing", exclude_if=lambda v: v == "fill_missing", description="with a `caption:` section, which"
        " images get a generated caption: fill_missing (those without a written one), replace (every image; the"
        " written caption stays on disk, unused), prefix / suffix (every image: caption_text + \", \" + generated, or"
        " generated + \", \" + caption_text), combine (written + \". \" + generated, or generated alone)")
    caption_text: str | None = Field(  # never in the preprocess key: the caption stage's
        None, exclude_if=lambda v: v is None, description="prefix / suffix: the text put before or after each"
        " generated caption (a trigger word)")

    control_dir: str | None = Field(  # unset: out of the preprocess key
        None, exclude_if=lambda v: v is None, description="edit pairs: a folder inside the dataset holding each target's reference image, matched by"
        " relative path without suffix (control/a.png is a.jpg's); its images are not targets")
    reference_columns: tuple[str, ...] = Field(  # unset: out of the preprocess key
        (), exclude_if=lambda v: not v, description="edit pairs: metadata columns naming a target's reference"
        " image(s), a path or a list of paths relative to the metadata file (after control_dir's, in order)")

    @property
    def label(self) -> str:
        return self.name or location_name(self.path)

    @property
    def pairs(self) -> bool:
        """Its targets come with reference images (an edit dataset)."""
        return bool(self.control_dir or self.reference_columns)

    @field_validator("control_dir")
    @classmethod
    def _control_dir_inside(cls, folder: str | None) -> str | None:
        if folder is None:
            return None
        rel = posixpath.normpath(folder)
        if rel in (".", "..") or rel.startswith(("../", "/")):
            raise ValueError(f"control_dir {folder!r} must name a folder inside the dataset, relative to it")
        return rel

    @model_validator(mode="after")
    def _pairs_in_folders(self) -> "DatasetSource":
        if self.pairs and self.format != "folder":
            raise ValueError(f"{self.path}: control_dir / reference_columns need the folder format (with"
                             f" metadata files), not {self.format}")
        return self

    @model_validator(mode="after")
    def _caption_text_with_its_policy(self) -> "DatasetSource":
        needs_text = self.caption_policy in ("prefix", "suffix")
        if needs_text and not (self.caption_text or "").strip():
            raise ValueError(f"caption_policy: {self.caption_policy} needs caption_text (the text put"
                             f" {'before' if self.caption_policy == 'prefix' else 'after'} each generated caption)")
        if not needs_text and self.caption_text is not None:
            raise ValueError(f"caption_text is set but caption_policy is {self.caption_policy}: caption_text is"
                             " used by caption_policy prefix or suffix only")
        return self

    @model_validator(mode="after")
    def _prior_not_held_out(self) -> "DatasetSource":
        if self.role == "prior" and self.split == "holdout":
            raise ValueError("split: holdout with role: prior: prior images are not the subject's evaluation data;"
                             " leave split at auto (a prior dataset is never held out)")
        return self

    @model_validator(mode="after")
    def _folder_on_object_storage(self) -> "DatasetSource":
        if is_url(self.path) and self.format != "folder":
            raise ValueError(f"{self.path}: only the folder format can be read from object storage; copy the"
                             f" {self.format} dataset to a local folder")
        return self

    @property
    def caption_exts(self) -> tuple[str, ...]:
        """Sidecar suffixes in order of preference."""
        return (self.caption_ext,) if self.caption_ext else DEFAULT_CAPTION_EXTS

    def with_defaults(self, **defaults) -> "DatasetSource":
        """This dataset with its unset settings taken from `defaults` (the preprocess section's)."""
        return self.model_copy(update={k: v for k, v in defaults.items() if getattr(self, k) is None})


@dataclass(frozen=True)
class MaskFile:
    """A sidecar mask (MASK_SUFFIX) of one image."""

    rel: str  # relative to the dataset folder
    open: Callable[[], BinaryIO]
    digest: Callable[[], str]


@dataclass(frozen=True)
class Candidate:
    """One image a dataset offers, before validation."""

    source: int  # index of its dataset in the config's list
    rel: str  # path relative to the dataset folder; "row-N" for hf / parquet rows
    label: str  # what the user sees: rel, prefixed by the dataset name when there are several
    caption: str | None  # None: no caption found
    caption_problem: str  # why there is no caption, should `caption` be None or blank
    open: Callable[[], BinaryIO]  # the image file, opened for reading (OSError when unreadable)
    digest: Callable[[], str]  # content digest of those bytes (stat-cached for files)
    mask: MaskFile | None = None  # its sidecar mask (a folder dataset with mask: sidecar)
    clip: Callable[[], ClipInfo] | None = None  # a video file's frames (VideoProblem if it is not a clip)
    references: tuple[Candidate, ...] = ()  # an edit pair's reference images, in order (references.py)
    reference_problem: tuple[str, str] | None = None  # (reason, detail): a reference missing, ambiguous, ...
    timed_captions: TimedCaptions | None = None  # a clip's captions per time range (its metadata row's)


@dataclass(frozen=True)
class Offered:
    """A dataset's candidates, and report entries for what it refused before validation."""

    candidates: list[Candidate]
    refused: list[dict]  # {"path", "reason", "detail"}


@dataclass(frozen=True)
class FolderScan:
    """What a folder dataset's samples are made of, decided from its listing alone."""

    listing: Listing
    images: dict[str, str | None]  # image -> the caption sidecar it would use, by relative path
    masks: dict[str, str]  # image -> its sidecar mask (mask: sidecar), by relative path
    metadata: tuple[str, ...]  # metadata files, by relative path
    refused: tuple[tuple[str, str, str], ...]  # (relative path, reason, detail)
    controls: dict[str, list[str]]  # control_dir's images by relative stem (references.py)


def scan_folder(source: DatasetSource) -> FolderScan:
    listing = list_folder(source.path, source.follow_symlinks)
    refused = [(rel, skip.reason, SKIPPED_DETAIL[skip.reason]) for rel, skip in listing.skipped.items()
               if skip.folder or _offered_name(rel)]
    images, masks = {}, {}
    for rel in (r for r in listing.files if _image_name(r) and not in_control_dir(r, source.control_dir)):
        stem = rel.rsplit(".", 1)[0]
        if source.mask == "sidecar" and stem + MASK_SUFFIX in listing.files:
            masks[rel] = stem + MASK_SUFFIX
        sidecar = next((s for s in (stem + ext for ext in source.caption_exts)
                        if s in listing.files or s in listing.skipped), None)
        if sidecar in listing.skipped:
            refused.append((rel, listing.skipped[sidecar].reason,
                            f"its caption {sidecar} is {SKIPPED_DETAIL[listing.skipped[sidecar].reason]}"))
        else:
            images[rel] = sidecar
    metadata = tuple(r for r in listing.files if posixpath.basename(r) in METADATA_FILES)
    controls = control_stems(listing, source.control_dir, _image_name) if source.control_dir else {}
    return FolderScan(listing, images, masks, metadata, tuple(refused), controls)


def _image_name(rel: str) -> bool:
    """An image or a clip: a file that can be a sample."""
    return rel.lower().endswith(IMAGE_SUFFIXES + VIDEO_SUFFIXES) and not rel.lower().endswith(MASK_SUFFIX)


def _offered_name(rel: str) -> bool:
    return _image_name(rel) or posixpath.basename(rel) in METADATA_FILES


def _file_digest(path: Path | ObjectFile, stat_cache: StatCache) -> str:
    """Its content digest; an unreadable file gets a marker that changes when it is fixed."""
    try:
        return stat_cache.digest(path)
    except OSError:
        if isinstance(path, ObjectFile):
            return f"unreadable:{path.size}:{path.etag}"
        st = path.lstat()
        return f"unreadable:{st.st_mode:o}:{st.st_size}:{st.st_mtime_ns}"


def fingerprint(source: DatasetSource, stat_cache: StatCache) -> str:
    """Relative paths and content digests of every file the dataset's samples come from, and what
    it refuses. `source` holds its settled caption settings (DatasetSource.with_defaults)."""
    if source.format != "folder":
        files = list_folder(source.path, source.follow_symlinks).files
        return digest_json([[rel, _file_digest(path, stat_cache)] for rel, path in files.items()])
    scan = scan_folder(source)
    controls = (rel for found in scan.controls.values() for rel in found)
    used = sorted({*scan.images, *filter(None, scan.images.values()), *scan.masks.values(), *scan.metadata, *controls})
    return digest_json({"files": [[rel, _file_digest(scan.listing.files[rel], stat_cache)] for rel in used],
                        "refused": scan.refused})


def candidates(source: DatasetSource, index: int, prefix: str, stat_cache: StatCache) -> Offered:
    """`source` holds its settled caption and row settings (DatasetSource.with_defaults)."""
    if source.format != "folder":
        return Offered(_table_candidates(source, index, prefix), [])
    scan = scan_folder(source)
    offered = {rel for rel in (*scan.listing.files, *scan.listing.skipped)
               if _image_name(rel) and not in_control_dir(rel, source.control_dir)}
    captions, problems = metadata_captions(scan.listing, offered, source.caption_column)
    if problems and source.on_bad_row == "error":
        raise ValueError(_bad_row_error(source, problems))
    references = {rel: _reference_names(source, scan, rel, captions.get(rel)) for rel in scan.images} \
        if source.pairs else {}
    referenced = {path for names in references.values() for path in names.paths}  # a reference is no target
    found = []
    for rel, sidecar in ((r, s) for r, s in scan.images.items() if r not in referenced):
        path = scan.listing.files[rel]
        caption, problem = _caption(source, rel, captions.get(rel), sidecar and scan.listing.files[sidecar])
        found.append(Candidate(index, rel, prefix + rel, caption, problem, lambda path=path: path.open("rb"),
                               lambda path=path: stat_cache.digest(path), _mask_file(scan, rel, stat_cache),
                               _clip(path, stat_cache) if rel.lower().endswith(VIDEO_SUFFIXES) else None,
                               *_reference_candidates(references.get(rel), index, scan, stat_cache),
                               timed_captions=captions[rel].timed if rel in captions else None))
    refused = [{"path": prefix + rel, "reason": reason, "detail": detail} for rel, reason, detail in scan.refused]
    refused += [{"path": prefix + p.where, "reason": p.reason, "detail": p.detail} for p in problems]
    return Offered(found, refused)


def _reference_candidates(found: ReferenceNames | None, index: int, scan: FolderScan, stat_cache: StatCache
                          ) -> tuple[tuple[Candidate, ...], tuple[str, str] | None]:
    """An image's reference images as candidates, or why it has none usable (None: not a pair)."""
    if found is None:
        return (), None
    files = [(rel, scan.listing.files[rel]) for rel in found.paths]
    return tuple(Candidate(index, rel, rel, None, "", lambda path=path: path.open("rb"),
                           lambda path=path: stat_cache.digest(path)) for rel, path in files), found.problem


def _reference_names(source: DatasetSource, scan: FolderScan, image: str, row: MetadataCaption | None
                     ) -> ReferenceNames:
    """The image's references: control_dir's, then its metadata row's reference_columns'."""
    control = control_reference(image, source.control_dir, scan.controls) if source.control_dir else ReferenceNames()
    listed = column_references(row.row, row.where, row.file, source.reference_columns, scan.listing, _image_name) \
        if row and source.reference_columns else ReferenceNames()
    return target_references(image, source.control_dir, control, source.reference_columns, listed,
                             row.where if row else None)


def _clip(path: Path | ObjectFile, stat_cache: StatCache) -> Callable[[], ClipInfo]:
    """A video file's frame record, decoded once per file version (the stat cache keeps it)."""
    def read() -> ClipInfo:
        if isinstance(path, ObjectFile):
            from ..video import VideoProblem

            raise VideoProblem("unsupported", "clips on object storage are not read yet: copy them to a local folder")
        record = stat_cache.derived(path, CLIP_RECORD, lambda local: json.dumps(read_clip(local).to_json()))
        return ClipInfo.from_json(json.loads(record))

    return read


def _mask_file(scan: FolderScan, image: str, stat_cache: StatCache) -> MaskFile | None:
    if image not in scan.masks:
        return None
    path = scan.listing.files[scan.masks[image]]
    return MaskFile(scan.masks[image], lambda: path.open("rb"), lambda: stat_cache.digest(path))


def _caption(source: DatasetSource, image: str, row: MetadataCaption | None, sidecar: Path | ObjectFile | None
             ) -> tuple[str | None, str]:
    """(caption, what to say should it be missing or blank) for the image at relative path `image`:
    the metadata row's, else the sidecar's."""
    if row and row.text is not None:
        return row.text, f"{row.where} has an empty {source.caption_column!r} value"
    if sidecar:
        try:
            return sidecar.read_text(encoding="utf-8", errors="replace"), f"{sidecar.name} is empty"
        except OSError as e:
            return None, f"caption file {sidecar.name} is unreadable ({e.strerror})"
    if row:
        return None, f"{row.where} has no {source.caption_column!r} value (caption_column)"
    stem = posixpath.basename(image).rsplit(".", 1)[0]
    return None, (f"looked for {', '.join(stem + ext for ext in source.caption_exts)} and a row naming it in a"
                  f" {' or '.join(METADATA_FILES)}")


def _bad_row_error(source: DatasetSource, problems: list[RowProblem]) -> str:
    first = problems[0]
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return (f"{source.path}/{first.where}: {first.reason}: {first.detail}{more}; on_bad_row is error"
            " (or --strict): fix the row, or set on_bad_row: skip to leave bad rows out")


def _table_candidates(source: DatasetSource, index: int, prefix: str) -> list[Candidate]:
    table = load_table(source.path, source.format, source.image_column)
    for column in (source.image_column, source.caption_column):
        if column not in table.column_names:
            raise ValueError(f"{source.path}: no column {column!r} (columns: {', '.join(table.column_names)})")
    found, no_caption = [], f"no {source.caption_column!r} value in this row"
    for row, caption in enumerate(table[source.caption_column]):
        read = lambda row=row: row_image_bytes(source, row)  # noqa: E731
        text = None if caption is None else str(caption)
        found.append(Candidate(index, f"row-{row}", f"{prefix}row-{row}", text, no_caption,
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


def row_image_bytes(source: DatasetSource, row: int) -> bytes:
    value = load_table(source.path, source.format, source.image_column)[row][source.image_column]
    if value.get("bytes") is None:  # a table that stores file paths: only those inside the dataset folder
        return named_inside(source.path, value["path"], source.follow_symlinks).read_bytes()
    return value["bytes"]


def read_image_bytes(source: DatasetSource, rel: str) -> bytes:
    """The bytes of a sample's image (what encode decodes)."""
    if source.format == "folder" and is_url(source.path):
        return read_url(join(source.path, rel))
    if source.format == "folder":
        return local_file(source, rel).read_bytes()
    return row_image_bytes(source, int(rel.removeprefix("row-")))


def local_file(source: DatasetSource, rel: str) -> Path:
    """A local folder dataset's file (a clip, which PyAV reads from a path), still inside the dataset."""
    path = source.path / rel
    if not (source.follow_symlinks or within(os.path.realpath(path), os.path.realpath(source.path))):
        raise OSError(f"{rel} now leads outside the dataset folder (a link?): not read")
    return path
