"""Preprocess: scan and validate a dataset folder; decide each image's crop; pick the held-out split.

Reads:  an image folder with caption sidecars (`<name>.txt`) or a `metadata.jsonl`
        (`{"file_name": ..., "text": ...}` per line), nested folders allowed.
Writes: dataset.json (per image: id, relative path, content digest, caption, original size,
        resized size, crop box, split) and report.json (rejected files and why). No pixels.
Key:    these params + the dataset fingerprint (relative paths and content digests of every
        image and caption file) — never the folder's location.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from blake3 import blake3
from PIL import Image, UnidentifiedImageError
from pydantic import Field

from cache.digest import StatCache, digest_json
from cache.store import Built

from .contract import Frozen, Log

VERSION = "1"
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")
METADATA_FILE = "metadata.jsonl"
DATASET_FILE = "dataset.json"


class PreprocessParams(Frozen):
    resolution: int = Field(512, ge=64, multiple_of=8, description="square training size in pixels")
    holdout_fraction: float = Field(0.1, ge=0, lt=1, description="share of images held out for evaluation")
    caption_ext: str = Field(".txt", pattern=r"^\.\w+$")
    missing_caption: Literal["error", "skip", "filename", "empty"] = "error"


@dataclass(frozen=True)
class PreprocessInputs:
    dataset_dir: Path
    stat_cache: StatCache


def dataset_fingerprint(dataset_dir: Path, caption_ext: str, stat_cache: StatCache) -> str:
    """Digest of every image and caption file's relative path and content (stat-cached)."""
    if not dataset_dir.is_dir():
        raise FileNotFoundError(f"dataset folder {dataset_dir} does not exist")
    wanted = set(IMAGE_SUFFIXES) | {caption_ext}
    entries = [
        [p.relative_to(dataset_dir).as_posix(), stat_cache.digest(p)]
        for p in sorted(dataset_dir.rglob("*"))
        if p.is_file() and (p.suffix.lower() in wanted or p.name == METADATA_FILE)
    ]
    return digest_json(entries)


def center_crop(width: int, height: int, resolution: int) -> tuple[list[int], list[int]]:
    """Resize so the short side is `resolution`, then crop the centre square: (resized hw, box)."""
    scale = resolution / min(width, height)
    w, h = max(resolution, round(width * scale)), max(resolution, round(height * scale))
    left, top = (w - resolution) // 2, (h - resolution) // 2
    return [h, w], [left, top, left + resolution, top + resolution]


def _captions_from_metadata(dataset_dir: Path) -> dict[str, str]:
    path = dataset_dir / METADATA_FILE
    if not path.exists():
        return {}
    captions = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            captions[row["file_name"]] = str(row["text"])
        except (ValueError, KeyError) as e:
            raise ValueError(f"{path}:{n}: needs a JSON object with file_name and text ({e})") from None
    return captions


def _caption(image: Path, rel: str, params: PreprocessParams, metadata: dict[str, str]) -> str | None:
    sidecar = image.with_suffix(params.caption_ext)
    if rel in metadata:
        text = metadata[rel]
    elif sidecar.is_file():
        text = sidecar.read_text(encoding="utf-8", errors="replace")
    else:
        text = None
    text = " ".join(text.split()) if text is not None else None
    if text:
        return text
    return {"error": None, "skip": None, "filename": image.stem.replace("_", " "), "empty": ""}[
        params.missing_caption
    ]


def _holdout_ids(ids: list[str], fraction: float) -> set[str]:
    """The same ids for the same fraction, whatever the folder order: rank by a hash of the id."""
    if fraction == 0 or len(ids) < 2:
        return set()
    k = min(len(ids) - 1, max(1, math.floor(len(ids) * fraction + 0.5)))
    return set(sorted(ids, key=lambda i: blake3(i.encode()).hexdigest())[:k])


def run(params: PreprocessParams, inputs: PreprocessInputs, out_dir: Path, work_dir: Path,
        options: None = None, log: Log = print) -> Built:
    root = inputs.dataset_dir
    metadata = _captions_from_metadata(root)
    samples, rejected = [], []
    images = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    for image in images:
        rel = image.relative_to(root).as_posix()
        try:
            with Image.open(image) as im:
                width, height = im.size
        except (UnidentifiedImageError, OSError) as e:
            rejected.append({"path": rel, "reason": f"unreadable image ({type(e).__name__})"})
            continue
        caption = _caption(image, rel, params, metadata)
        if caption is None:
            if params.missing_caption == "error":
                raise ValueError(f"{image}: no caption (no {params.caption_ext} sidecar or {METADATA_FILE} entry);"
                                 " set preprocess.missing_caption to skip, filename or empty")
            rejected.append({"path": rel, "reason": "missing caption"})
            continue
        resized, box = center_crop(width, height, params.resolution)
        samples.append({
            "id": rel.rsplit(".", 1)[0], "path": rel, "digest": inputs.stat_cache.digest(image),
            "caption": caption, "original_size": [height, width], "size": [params.resolution] * 2,
            "resized": resized, "crop_box": box,
        })
    if not samples:
        raise ValueError(f"dataset folder {root} has no usable image ({len(rejected)} rejected)")
    holdout = _holdout_ids([s["id"] for s in samples], params.holdout_fraction)
    for s in samples:
        s["split"] = "holdout" if s["id"] in holdout else "train"
    (out_dir / DATASET_FILE).write_text(json.dumps({"format": 1, "samples": samples}, indent=1, sort_keys=True))
    (out_dir / "report.json").write_text(json.dumps({"rejected": rejected}, indent=1, sort_keys=True))
    for r in rejected:
        log(f"preprocess: skipped {r['path']}: {r['reason']}")
    log(f"preprocess: {len(samples)} images ({len(holdout)} held out), {len(rejected)} rejected")
    return Built(info={"images": len(samples), "holdout": len(holdout), "rejected": len(rejected)})
