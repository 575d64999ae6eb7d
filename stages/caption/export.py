"""Generated captions as caption sidecars next to their images (`lorapipe captions export`).

Only generated captions are written: the captioner's text, without a policy's trigger word or the
written caption it was combined with (a later run reads it as the image's written caption, and
its policy makes the same final caption again). An image the stage could not read (left_out) has
none: it is listed as skipped, with why, as is every sidecar not written. A file already there is never replaced unless
`overwrite`: the sidecar is written to a temporary file, then linked to its name, which fails when
the name exists (no window in which a user's file could be lost), or renamed over it with
`overwrite`. A reader never sees half a sidecar.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from lorapipe.cache.objects import is_url

from ..preprocess.sources import DatasetSource, local_file
from . import LEFT_OUT


@dataclass(frozen=True)
class Skipped:
    path: str  # the sidecar (or, when it has none, the image) as the user knows it
    reason: str


def export_captions(captions: dict, datasets: tuple[DatasetSource, ...],
                    overwrite: bool) -> tuple[list[Path], list[Skipped]]:
    """(sidecars written, what was not written and why) for captions.json's content; `datasets`
    with their caption settings settled (a dataset's caption_ext, else the preprocess section's)."""
    by_label = {d.label: d for d in datasets}
    written, skipped, done = [], [], set()
    for entry in sorted(captions["samples"].values(), key=lambda e: (e["dataset"], e["path"])):
        if entry["source"] == LEFT_OUT:
            skipped.append(Skipped(f"{entry['dataset']}/{entry['path']}", "not captioned: the image could not be read"
                                   " (the review's warnings say why)"))
            continue
        if entry["generated"] is None or (entry["dataset"], entry["path"]) in done:
            continue  # a written caption stays the user's; a clip's windows share one sidecar: its first
        done.add((entry["dataset"], entry["path"]))
        source = by_label[entry["dataset"]]
        if source.format != "folder" or is_url(source.path):
            skipped.append(Skipped(f"{entry['dataset']}/{entry['path']}", "its dataset is not a local folder"
                                   f" ({source.format} at {source.path}): no sidecar can go next to it"))
            continue
        sidecar = local_file(source, entry["path"].rsplit(".", 1)[0] + source.caption_exts[0])
        reason = write_sidecar(sidecar, entry["generated"] + "\n", overwrite)
        if reason:
            skipped.append(Skipped(str(sidecar), reason))
        else:
            written.append(sidecar)
    return written, skipped


def write_sidecar(path: Path, text: str, overwrite: bool) -> str:
    """Write `text` at `path` atomically; "" when written, else why not."""
    if path.is_file() and path.read_text(errors="replace") == text:
        return "already holds this caption"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    try:
        if overwrite:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # atomic, and refuses an existing name (os.replace would not)
    except FileExistsError:
        return "a file is there already (--overwrite replaces it)"
    finally:
        tmp.unlink(missing_ok=True)
    return ""
