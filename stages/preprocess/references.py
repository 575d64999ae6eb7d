"""Edit pairs: which reference images belong to each target, and where each reference is placed.

A folder dataset names references two ways, both optional: `control_dir`, a folder inside the
dataset whose images are matched to targets by relative path without suffix (control/a.png is
a.jpg's reference; the folder is no source of targets), and `reference_columns`, metadata columns
whose value is a path or a list of paths relative to the metadata file (the same rules as
`file_name`: nothing outside the dataset; an image a row names as a reference is no target). A
target's references are control_dir's, then the
columns' in order. A target whose reference is missing, ambiguous (two control files of one
stem), outside the dataset, named by a malformed value or unreadable is rejected with a report
row naming the file (and the metadata line): never trained unpaired.

A reference is placed in its target's bucket (resized to cover it, centre-cropped), so a batch's
references share the targets' size; the placement is in its latent record's key.
"""
from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Callable

from .listing import Listing


@dataclass(frozen=True)
class ReferenceNames:
    """What a target's references are, by relative path, or why it has none usable."""

    paths: tuple[str, ...] = ()
    problem: tuple[str, str] | None = None  # (report reason, detail)


def control_stems(listing: Listing, control_dir: str, is_image: Callable[[str], bool]) -> dict[str, list[str]]:
    """control_dir's images by relative stem inside it: {"sub/a": ["control/sub/a.png"]}."""
    prefix = control_dir.rstrip("/") + "/"
    stems: dict[str, list[str]] = {}
    for rel in listing.files:
        if rel.startswith(prefix) and is_image(rel):
            stems.setdefault(rel[len(prefix):].rsplit(".", 1)[0], []).append(rel)
    return stems


def in_control_dir(rel: str, control_dir: str | None) -> bool:
    return bool(control_dir) and rel.startswith(control_dir.rstrip("/") + "/")


def control_reference(image: str, control_dir: str, stems: dict[str, list[str]]) -> ReferenceNames:
    """The target's reference in control_dir, by its relative stem."""
    stem = image.rsplit(".", 1)[0]
    found = stems.get(stem, [])
    if not found:
        return ReferenceNames(problem=("missing_reference", f"no {control_dir}/{stem}.* reference image"
                                               f" for it in control_dir"))
    if len(found) > 1:
        return ReferenceNames(problem=("ambiguous_reference", f"{' and '.join(found)} both match it in"
                                               " control_dir: keep one"))
    return ReferenceNames((found[0],))


def column_references(row: dict, where: str, metadata: str, columns: tuple[str, ...], listing: Listing,
                      is_image: Callable[[str], bool]) -> ReferenceNames:
    """The references a metadata row names in `columns` (a path or a list of paths, relative to
    the metadata file), each an image file of the dataset (and so no target)."""
    paths = []
    for column in columns:
        value = row.get(column)
        names = [value] if isinstance(value, str) else value
        if not isinstance(names, list) or not names or not all(isinstance(n, str) and n.strip() for n in names):
            return ReferenceNames(problem=("bad_reference", f"{where}: {column!r} must be a file name or a"
                                                   f" list of file names, not {value!r}"))
        for name in names:
            rel = posixpath.normpath(posixpath.join(posixpath.dirname(metadata), name))
            if rel == ".." or rel.startswith(("../", "/")):
                return ReferenceNames(problem=("outside_dataset", f"{where}: reference {name!r} is outside"
                                                       " the dataset folder"))
            if rel not in listing.files:
                reason = listing.skipped[rel].reason if rel in listing.skipped else "missing_reference"
                return ReferenceNames(problem=(reason, f"{where}: reference {name!r}: no such file in the"
                                                       " dataset" if reason == "missing_reference" else
                                                       f"{where}: reference {name!r} is a link to outside the dataset"))
            if not is_image(rel):
                return ReferenceNames(problem=("bad_reference", f"{where}: reference {name!r} is not an image file"))
            paths.append(rel)
    return ReferenceNames(tuple(paths))
