"""A folder's files, with links kept inside it: what a dataset may offer, no file opened.

A file belongs to a folder when its resolved path lies inside the folder's resolved path. A link
leading outside is listed as skipped, not followed, unless the caller opts in; a linked folder
leading back to a folder above it (a loop) is skipped, never walked.

A folder on object storage (`s3://bucket/prefix`) is every object under `prefix/`, listed with
its size and ETag (no file opened either). Object storage has no links, so nothing can lead
outside it: every object under the prefix belongs to the dataset and `follow_symlinks` changes
nothing. Hidden names (a path component starting with ".") are skipped as on disk.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from lorapipe.cache.objects import ObjectFile, is_url, list_files

SkipReason = Literal["outside_dataset", "symlink_loop", "unreadable"]


@dataclass(frozen=True)
class Skipped:
    reason: SkipReason
    folder: bool  # a folder (not walked) rather than a file


@dataclass(frozen=True)
class Listing:
    files: dict[str, Path | ObjectFile]  # by path relative to the folder ("a/b.jpg"), sorted; dangling links included
    skipped: dict[str, Skipped]  # by relative path, sorted


def within(real_path: str, real_root: str) -> bool:
    return real_path == real_root or real_path.startswith(real_root.rstrip(os.sep) + os.sep)


class OutsideDataset(Exception):
    """A file a dataset names (a table row's image path) that lies outside the dataset's folder."""


def named_inside(root: Path, name: str, follow_symlinks: bool) -> Path:
    """The file `name` (relative to `root`, or absolute) names, refused when it resolves outside
    `root` and the dataset does not set `follow_symlinks`."""
    path = root / name
    if not (follow_symlinks or within(os.path.realpath(path), os.path.realpath(root))):
        raise OutsideDataset(f"image path {name!r} is outside the dataset folder (set follow_symlinks: true"
                             " on this dataset to read it)")
    return path


def list_folder(root: Path | str, follow_symlinks: bool = False) -> Listing:
    """Every file under `root`, hidden files and folders skipped; links to outside it are
    followed only with `follow_symlinks`. Reads directory entries and link targets only."""
    if is_url(root):
        return _list_objects(root)
    if not root.is_dir():
        raise FileNotFoundError(f"dataset folder {root} does not exist")
    real_root = os.path.realpath(root)
    files: list[tuple[str, ...]] = []
    skipped: dict[str, Skipped] = {}
    pending = [((), str(root), (real_root,))]  # (relative parts, path, resolved paths of it and its parents)
    while pending:
        parts, folder, chain = pending.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            skipped["/".join(parts) or "."] = Skipped("unreadable", True)
            continue
        for entry in (e for e in entries if not e.name.startswith(".")):
            rel = (*parts, entry.name)
            if not entry.is_symlink():
                if entry.is_dir(follow_symlinks=False):
                    pending.append((rel, entry.path, (*chain, os.path.join(chain[-1], entry.name))))
                elif entry.is_file(follow_symlinks=False):  # not a FIFO or device: opening one could block
                    files.append(rel)
                continue
            real, is_dir = os.path.realpath(entry.path), os.path.isdir(entry.path)  # False when dangling
            if not (follow_symlinks or within(real, real_root)):
                skipped["/".join(rel)] = Skipped("outside_dataset", is_dir)
            elif is_dir and real in chain:
                skipped["/".join(rel)] = Skipped("symlink_loop", True)
            elif is_dir:
                pending.append((rel, entry.path, (*chain, real)))
            elif os.path.isfile(entry.path) or not os.path.exists(entry.path):  # dangling: reported unreadable
                files.append(rel)
    return Listing({"/".join(parts): root.joinpath(*parts) for parts in sorted(files)}, dict(sorted(skipped.items())))


def _list_objects(url: str) -> Listing:
    files = {rel: f for rel, f in list_files(url).items() if not any(part.startswith(".") for part in rel.split("/"))}
    if not files:
        raise FileNotFoundError(f"dataset folder {url} does not exist (no objects under it)")
    return Listing(files, {})


def listed_files(root: Path) -> list[Path]:
    """The files of `list_folder`, sorted by relative path."""
    return list(list_folder(root).files.values())
