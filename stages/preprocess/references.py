"""Edit pairs: which reference images belong to each target, and where each reference is placed.

A folder dataset names references two ways, both optional: `control_dir`, a folder inside the
dataset whose images are matched to targets by relative path without suffix (control/a.png is
a.jpg's reference; the folder is no source of targets), and `reference_columns`, metadata columns
whose value is a path or a list of paths relative to the metadata file (the same rules as
`file_name`: nothing outside the dataset; an image a row names as a reference is no target). A
target's references are control_dir's, then the columns' in order; with both set, either may give
them (a target without a control image may name its references in its row, and a row without the
columns may pair a target that has one). A target with no reference at all is
`missing_reference`; one whose reference is ambiguous (two control files of one stem), outside the
dataset, named by a malformed value or unreadable is rejected with a report row naming the file
(and the metadata line): never trained unpaired.

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
    """The target's reference in control_dir, by its relative stem (none: no paths, no problem)."""
    found = stems.get(image.rsplit(".", 1)[0], [])
    if len(found) > 1:
        return ReferenceNames(problem=("ambiguous_reference", f"{' and '.join(found)} both match it in"
                                               " control_dir: keep one"))
    return ReferenceNames(tuple(found))


def target_references(image: str, control_dir: str | None, control: ReferenceNames, columns: tuple[str, ...],
                      listed: ReferenceNames, row_where: str | None) -> ReferenceNames:
    """A target's references, control_dir's then its row's, or why it has none usable; the paths
    found are kept with a problem (a file a row names is no target either way)."""
    paths, problem = control.paths + listed.paths, control.problem or listed.problem
    if paths or problem:
        return ReferenceNames(paths, problem)
    looked = [f"no {control_dir}/{image.rsplit('.', 1)[0]}.* in control_dir"] if control_dir else []
    if columns:
        names = ", ".join(columns)
        looked.append(f"{row_where}: no {names} column" if row_where else f"no metadata row names its references ({names})")
    return ReferenceNames(problem=("missing_reference", " and ".join(looked)))


def column_references(row: dict, where: str, metadata: str, columns: tuple[str, ...], listing: Listing,
                      is_image: Callable[[str], bool]) -> ReferenceNames:
    """The references a metadata row names in `columns` (a path or a list of paths, relative to
    the metadata file), each an image file of the dataset (and so no target); a column the row
    lacks (or leaves null or empty) names none."""
    paths = []
    for column in (c for c in columns if row.get(c) not in (None, "")):  # a CSV's empty cell: ""
        value = row[column]
        names = [value] if isinstance(value, str) else value
        if not isinstance(names, list) or not names or not all(isinstance(n, str) and n.strip() for n in names):
            return ReferenceNames(tuple(paths), ("bad_reference", f"{where}: {column!r} must be a file name or a"
                                                   f" list of file names, not {value!r}"))
        for name in names:
            rel = posixpath.normpath(posixpath.join(posixpath.dirname(metadata), name))
            if rel == ".." or rel.startswith(("../", "/")):
                return ReferenceNames(tuple(paths), ("outside_dataset", f"{where}: reference {name!r} is outside"
                                                       " the dataset folder"))
            if rel not in listing.files:
                reason = listing.skipped[rel].reason if rel in listing.skipped else "missing_reference"
                return ReferenceNames(tuple(paths), (reason, f"{where}: reference {name!r}: no such file in the"
                                                       " dataset" if reason == "missing_reference" else
                                                       f"{where}: reference {name!r} is a link to outside the dataset"))
            if not is_image(rel):
                return ReferenceNames(tuple(paths), ("bad_reference", f"{where}: reference {name!r} is not an image file"))
            paths.append(rel)
    return ReferenceNames(tuple(paths))
