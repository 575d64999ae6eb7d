"""Preprocess: scan and validate the datasets; decide each image's target size and crop box;
pick the held-out split. No pixels are decoded (headers only) and none are written.

Reads:  one or more datasets (stages/preprocess/sources.py): nested image folders with caption
        sidecars, imagefolder metadata.jsonl / metadata.csv, saved `datasets` folders or parquet.
Writes: dataset.json: per sample id, dataset index (`source`), relative path, content digest,
        caption (a clip window's: its time range's, where its metadata row gives ranges), repeats,
        original size, target size (a square or a bucket), resized size, crop box, split,
        `background` for images with alpha, and `mask` for images with a loss mask
        (a sidecar's path and digest, or the alpha channel: the dataset's `mask` setting),
        `role: prior` for images of a prior dataset (never held out), `written: false` for an image
        without a caption that the caption stage is to caption (missing_caption: generate), and for an edit pair its
        `references` (each reference image's path, digest, sizes and crop box in the target's
        bucket: stages/preprocess/references.py); for an image-to-video model, each clip window's
        conditioning image as its one reference: the image the dataset names, else the window's
        first sampled frame (`frames`, its digest that frame's);
        report.json: every rejected file or metadata row, its reason and detail, counts per
        reason, and warnings (`small_image`); rejected.json, when something is rejected: the
        rejected rows and counts, published to the run's output folder.
Key:    these params + per dataset its settings and a fingerprint of its files (relative paths and
        content digests, stat-cached, and what it refuses) — never a folder's location; with edit
        pairs, the model's bound on a target's references (its family's `max_references`); for an
        image-to-video model, that it conditions windows on an image.
"""
from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from lorapipe.cache.digest import StatCache, digest_json
from lorapipe.cache.store import Built

from ..contract import Frozen, Log, OutputFile
from ..video import ClipInfo
from .clips import VideoSampling, Window, cut_summary, inspect_clip, window_captions, window_digest, windows
from .crops import generated_buckets, nearest_bucket, place, shrink_to_fit
from .rows import SampleRow, write_rows
from .sources import BadRow, Candidate, DatasetSource, MissingCaption, candidates, fingerprint
from .validation import ImageInfo, Rejected, inspect_image, mask_entry, summary_lines

# 3: nothing read outside a dataset, metadata row problems reported, .caption fallback, warnings;
# 4: the held-out split and random crops chosen by image content, not file name;
# 5: edit pairs: control_dir or reference_columns may pair a target, a row without the column is no
# reference, too_many_references, rejected.json; a PNG's pixels are not decoded (damage shows at encode);
# 6: a clip that decodes short of its container's duration, or an MP4 without its index, is truncated;
# a mirroring display matrix is refused; a one-frame clip is a one-frame window
VERSION = "6"
REJECTED_FILE = "rejected.json"
OUTPUT_FILES = (OutputFile(REJECTED_FILE, "rejected files"),)  # its dataset manifest is encode's input, not the user's
MAX_UPSCALE = 2.0  # an image enlarged more than this to cover its target gets a small_image warning
DATASET_FILE = "dataset.json"
CAPTION_SETTINGS = ("caption_policy", "caption_text")  # a dataset's settings for the caption stage, not preprocess
REPORT_FILE = "report.json"
FINDINGS_FILE = REPORT_FILE  # the rejected files and warnings the run's report.md lists

__all__ = ["VERSION", "OUTPUT_FILES", "DATASET_FILE", "DatasetSource", "PreprocessParams", "PreprocessInputs",
           "dataset_ingredients", "run"]


class PreprocessParams(Frozen):
    resolution: int = Field(512, ge=64, multiple_of=8, description="square side, or √(bucket area), in pixels")
    holdout_fraction: float = Field(0.1, ge=0, lt=1, description="the share of images held out for evaluation:"
                                    " those of smallest content digest, whatever their names")
    caption_ext: str | None = Field(None, pattern=r"^\.\w+$", description="the caption sidecar's suffix (a"
                                    " dataset's own wins); unset: .txt, or kohya's .caption where no .txt exists")
    missing_caption: MissingCaption = Field("error", description="an image without a caption: error, skip,"
                                            " filename, empty or generate (a dataset's own setting wins); with a"
                                            " `caption:` section, unset means generate")
    on_bad_row: BadRow = Field("skip", description="a metadata row that cannot be used is skipped and listed in"
                               " report.json, or stops the run (error; `--strict`); a dataset's own setting wins")
    crop: Literal["center", "random"] = Field("center", description="where an image is cropped to its target;"
                                              " random: placed from seed and the image's content, the same every"
                                              " epoch")
    seed: int = Field(0, description="places random crops")
    buckets: bool = Field(False, description="crop each image to the bucket of nearest aspect ratio instead of"
                          " a square")
    bucket_sizes: tuple[tuple[int, int], ...] = Field((), description="the buckets as [width, height]"
                                                      " pairs, multiples of 64; default: generated with about"
                                                      " resolution² pixels each, up to max_aspect")
    max_aspect: float = Field(2.0, ge=1, description="the largest long-to-short side ratio of generated buckets")
    never_upscale: bool = Field(False, description="an image smaller than its target trains at a smaller target"
                                " (sides multiples of 64) instead of being enlarged")
    min_side: int = Field(0, ge=0, description="reject images whose short side is smaller")
    background: tuple[int, int, int] = Field((255, 255, 255), description="RGB that alpha is composited on")
    video: VideoSampling = Field(  # at its default out of the key: image-only configs keep their keys
        VideoSampling(), exclude_if=lambda v: v == VideoSampling(), description="how clips (video files)"
        " are cut into windows of frames")

    @field_validator("bucket_sizes")
    @classmethod
    def _multiples_of_64(cls, sizes: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
        if any(side <= 0 or side % 64 for size in sizes for side in size):
            raise ValueError("every bucket side must be a positive multiple of 64")
        return sizes

    @field_validator("background")
    @classmethod
    def _rgb(cls, rgb: tuple[int, int, int]) -> tuple[int, int, int]:
        if any(not 0 <= c <= 255 for c in rgb):
            raise ValueError("background must be three values from 0 to 255")
        return rgb


@dataclass(frozen=True)
class PreprocessInputs:
    datasets: tuple[DatasetSource, ...]
    stat_cache: StatCache
    max_references: int | None = None  # the model's bound on a target's references (its family's); None: unchecked
    image_condition: bool = False  # the model conditions each clip window on an image (Family.image_condition)


def dataset_ingredients(datasets: tuple[DatasetSource, ...], params: PreprocessParams,
                        stat_cache: StatCache) -> dict:
    """Per dataset (by name when there are several) its keyed settings and files' fingerprint."""
    several = len(datasets) > 1
    return {
        (d.label if several else "data"): {**d.model_dump(mode="json", exclude={"path", "name", *CAPTION_SETTINGS}),
                                           "files": fingerprint(settled, stat_cache)}
        for d, settled in zip(datasets, _settled(datasets, params))
    }


def _settled(datasets: tuple[DatasetSource, ...], params: PreprocessParams) -> tuple[DatasetSource, ...]:
    """Each dataset with its unset caption and row settings taken from the preprocess section."""
    return tuple(d.with_defaults(caption_ext=params.caption_ext, missing_caption=params.missing_caption,
                                 on_bad_row=params.on_bad_row) for d in datasets)


def run(params: PreprocessParams, inputs: PreprocessInputs, out_dir: Path, work_dir: Path,
        options: None = None, log: Log = print) -> Built:
    datasets = _settled(inputs.datasets, params)
    several = len(datasets) > 1
    offered = [candidates(d, i, f"{d.label}/" if several else "", inputs.stat_cache) for i, d in enumerate(datasets)]
    samples, rejected, warnings = _validate([c for o in offered for c in o.candidates], params, datasets, inputs)
    rejected = [r for o in offered for r in o.refused] + rejected
    if not samples:
        where = ", ".join(str(d.path) for d in inputs.datasets)
        raise ValueError(f"no usable image in {where} ({_reasons(rejected)})")
    _check_every_dataset_used(datasets, samples, rejected)
    fixed = {s.id: _fixed_split(inputs.datasets[s.source]) for s in samples}  # a dataset may name its split
    group = {s.id: s.clip.digest if s.clip else s.digest for s in samples}  # a clip's windows: one
    held = _holdout_ids({group[i]: group[i] for i, split in fixed.items() if split == "auto"}, params.holdout_fraction)
    holdout = {i for i, split in fixed.items() if split == "auto" and group[i] in held}
    holdout |= {i for i, split in fixed.items() if split == "holdout"}
    samples = [s.model_copy(update={"split": "holdout"}) if s.id in holdout else s for s in samples]
    counts = dict(sorted(Counter(r["reason"] for r in rejected).items()))
    buckets = dict(sorted(Counter(f"{s.size[1]}x{s.size[0]}" for s in samples).items()))
    write_rows(out_dir / DATASET_FILE, samples)
    report = {"rejected": rejected, "counts": counts, "warnings": warnings, **_clips_report(samples, datasets)}
    (out_dir / REPORT_FILE).write_text(json.dumps(report, indent=1, sort_keys=True))
    if rejected:  # the user's copy, beside the run's outputs; absent when nothing is refused
        (out_dir / REJECTED_FILE).write_text(json.dumps({"rejected": rejected, "counts": counts}, indent=1,
                                                        sort_keys=True))
    for line in summary_lines(rejected, "rejected") + summary_lines(warnings, "warning:"):
        log(line)
    prior = sum(s.role == "prior" for s in samples)
    log(f"preprocess: {_counted(samples)} ({len(holdout)} held out{f', {prior} prior' if prior else ''}) from"
        f" {len(inputs.datasets)} dataset(s), {len(rejected)} rejected, {len(warnings)} warnings; sizes (WxH): {buckets}")
    return Built(info={"images": len(samples), "holdout": len(holdout), "rejected": len(rejected),
                       "rejected_by_reason": counts, "warnings": len(warnings), "sizes": buckets})


def _counted(samples: list[SampleRow]) -> str:
    """The samples as the log counts them: images, and the windows of clips ("6 windows of 6 clips")."""
    windows = [s for s in samples if s.clip]
    clips = f"{len(windows)} windows of {len({s.clip.digest for s in windows})} clips" if windows else ""
    images = f"{len(samples) - len(windows)} images" if len(samples) > len(windows) else ""
    return " and ".join(part for part in (images, clips) if part)


def _reasons(rejected: list[dict]) -> str:
    return ", ".join(f"{n} {r}" for r, n in sorted(Counter(r["reason"] for r in rejected).items())) or "no image files"


def _check_every_dataset_used(datasets: tuple[DatasetSource, ...], samples: list[SampleRow],
                              rejected: list[dict]) -> None:
    """One of several datasets without a usable image is a mistake (a wrong path; a prior dataset
    would regularise nothing), not a dataset to leave out silently: one line naming it."""
    used = {s.source for s in samples}
    for i, d in enumerate(datasets):
        if i not in used:
            mine = [r for r in rejected if r["path"].startswith(f"{d.label}/")]
            role = " (role: prior)" if d.role == "prior" else ""
            raise ValueError(f"no usable image in dataset {d.label!r}{role}, {d.path} ({_reasons(mine)}): fix its path"
                             " or images, or remove it from data.datasets")


def _validate(found: list[Candidate], params: PreprocessParams, datasets: tuple[DatasetSource, ...],
              inputs: PreprocessInputs) -> tuple[list[SampleRow], list[dict], list[dict]]:
    """(samples, rejected, warnings); the first of identical files (by path) is kept."""
    samples, rejected, warnings, uncaptioned = [], [], [], []
    first_of: dict[str, str] = {}  # content digest or sample id -> the file that has it
    for c in found:
        source = datasets[c.source]
        sample_id = c.label.rsplit(".", 1)[0]
        try:
            info, clip = inspect_clip(c, params.min_side) if c.clip else (inspect_image(c, params.min_side), None)
            # a clip with time-ranged captions takes its windows' captions from them (_clip_samples)
            caption = "" if c.timed_captions else _caption(c, source.missing_caption)
            if caption is None:
                uncaptioned.append(c)
                continue
            for seen, what in ((info.digest, "same frames as" if clip else "same bytes as"),
                               (sample_id, "same name (so the same id) as")):
                if seen in first_of:
                    raise Rejected("duplicate", f"{what} {first_of[seen]}")
            if clip:
                if (c.references or c.reference_problem) and not inputs.image_condition:
                    raise Rejected("unsupported", "a clip cannot be an edit target (control_dir / reference_columns)")
                samples.extend(_clip_samples(c, sample_id, info, clip, caption, source, params, inputs))
                warnings.extend(_clip_warnings(c, clip))
            else:
                mask = mask_entry(c, info, source)
                sample = _sample(c, sample_id, info, caption, source, params)
                if c.references or c.reference_problem:
                    sample["references"] = _placed_references(c, sample["size"], params, inputs.max_references)
                samples.append(SampleRow.model_validate({**sample, "mask": mask}))
            first_of.update({info.digest: c.label, sample_id: c.label})
        except Rejected as r:
            rejected.append({"path": c.label, "reason": r.reason, "detail": r.detail})
            continue
        if small := _small_image(samples[-1]):
            warnings.append({"path": c.label, "reason": "small_image", "detail": small})
    if uncaptioned:
        c, more = uncaptioned[0], f" (and {len(uncaptioned) - 1} more)" if len(uncaptioned) > 1 else ""
        raise ValueError(f"{datasets[c.source].path}/{c.rel}: no caption ({c.caption_problem}){more}; set"
                         " missing_caption (preprocess or the dataset's) to skip, filename or empty")
    return samples, rejected, warnings


def _placed_references(c: Candidate, size: list[int], params: PreprocessParams,
                        max_references: int | None) -> list[dict]:
    """The target's reference images placed in its bucket (stages/preprocess/references.py), or
    Rejected naming the reference that cannot be used."""
    if c.reference_problem:
        raise Rejected(*c.reference_problem)
    if max_references and len(c.references) > max_references:
        raise Rejected("too_many_references", f"{len(c.references)} references ({', '.join(r.rel for r in c.references)}),"
                       f" but the model takes at most {max_references}")
    placed = []
    for ref in c.references:
        try:
            info = inspect_image(ref, 0)
        except Rejected as r:
            raise Rejected("bad_reference", f"its reference {ref.rel}: {r.reason}: {r.detail}") from None
        resized, box = place(info.width, info.height, (size[1], size[0]), False, 0, info.digest)  # centre-cropped
        placed.append({"path": ref.rel, "digest": info.digest, "original_size": [info.height, info.width],
                       "resized": resized, "crop_box": box,
                       **({"background": list(params.background)} if info.has_alpha else {})})
    return placed


def _clip_samples(c: Candidate, sample_id: str, info: ImageInfo, clip: ClipInfo, caption: str,
                  source: DatasetSource, params: PreprocessParams, inputs: PreprocessInputs) -> list[SampleRow]:
    """One sample per window of the clip (preprocess.video), each placed as an image of the clip's
    frame size would be, known by the digest of the frames it shows, captioned by `caption` or its
    time range's caption; `clip` says where it comes from (its windows share the clip's digest: held
    out together). For an image-to-video model, each with its conditioning image (_condition_image)."""
    sampling = params.video
    chosen = windows(clip, sampling)
    captions = window_captions(clip, chosen, sampling.fps, c.timed_captions) if c.timed_captions \
        else [caption] * len(chosen)
    samples = []
    for k, (window, caption) in enumerate(zip(chosen, captions)):
        digest = window_digest(clip, window)
        sample = _sample(c, sample_id if len(chosen) == 1 else f"{sample_id}@{k}",
                         ImageInfo(info.width, info.height, False, digest), caption, source, params)
        if inputs.image_condition:
            sample["references"] = _condition_image(c, sample, clip, window, params, inputs)
        samples.append(SampleRow.model_validate({
            **sample, "frames": window.frames, "fps": sampling.fps,
            "clip": {"digest": info.digest, "duration": round(clip.duration, 3), "fps": round(clip.fps, 3),
                     "start": window.start, "cut": cut_summary(clip, chosen, sampling.fps)}}))
    return samples


def _condition_image(c: Candidate, sample: dict, clip: ClipInfo, window: Window, params: PreprocessParams,
                     inputs: PreprocessInputs) -> list[dict]:
    """A window's conditioning image: the one the dataset names (placed as an edit pair's reference),
    else (none named) its first sampled frame, placed as the window is."""
    if c.references or (c.reference_problem and c.reference_problem[0] != "missing_reference"):
        return _placed_references(c, sample["size"], params, inputs.max_references)
    first = window.frames[0]
    return [{"path": sample["path"], "digest": digest_json([clip.digests[first]]), "frames": [first],
             **{k: sample[k] for k in ("original_size", "resized", "crop_box")}}]


def _clips_report(samples: list[SampleRow], datasets: tuple[DatasetSource, ...]) -> dict:
    """Per clip: its duration and frame rate, each window's start, frames and bucket, and what the
    windows leave out (absent when there is no clip, so an image dataset's report is unchanged)."""
    clips: dict[str, dict] = {}
    for s in (s for s in samples if s.clip):
        entry = clips.setdefault(s.label(datasets), {"path": s.label(datasets), "duration": s.clip.duration,
                                                     "fps": s.clip.fps, "cut": s.clip.cut, "windows": []})
        entry["windows"].append({"id": s.id, "start": s.clip.start, "frames": s.frame_count,
                                 "size": f"{s.size[1]}x{s.size[0]}", "split": s.split})
    return {"clips": list(clips.values())} if clips else {}


def _clip_warnings(c: Candidate, clip: ClipInfo) -> list[dict]:
    if not clip.variable_frame_rate:
        return []
    return [{"path": c.label, "reason": "variable_frame_rate",
             "detail": f"frame intervals vary around {clip.frame_interval * 1000:.1f} ms: sampled by the frames'"
                       " own timestamps"}]


def _small_image(sample: SampleRow) -> str:
    """Why the sample is far below its target size ("" when it is not)."""
    (h, w), (th, tw) = sample.original_size, sample.size
    scale = max(th / h, tw / w)
    if scale <= MAX_UPSCALE:
        return ""
    return (f"{w}x{h} is enlarged {scale:.1f}x to cover {tw}x{th} (set min_side to reject such images, or"
            " never_upscale to train it at a smaller size)")


def _caption(c: Candidate, policy: str) -> str | None:
    """The caption, whitespace collapsed; missing or empty ones follow `policy` (None: error)."""
    text = " ".join((c.caption or "").split())
    if text:
        return text
    if policy == "skip":
        raise Rejected("missing_caption", c.caption_problem)
    return {"error": None, "filename": c.rel.rsplit("/", 1)[-1].rsplit(".", 1)[0].replace("_", " "),
            "empty": "", "generate": ""}[policy]


def _fixed_split(source: DatasetSource) -> str:
    """The split a dataset's samples go to: its `split`, and a prior dataset's always train (its images
    regularise the subject's training; they are not the subject's evaluation data)."""
    return "train" if source.role == "prior" else source.split


def _sample(c: Candidate, sample_id: str, info: ImageInfo, caption: str, source: DatasetSource,
            params: PreprocessParams) -> dict:
    if params.buckets:
        target = nearest_bucket(info.width, info.height, list(params.bucket_sizes)
                                or generated_buckets(params.resolution, params.max_aspect))
    else:
        target = (params.resolution, params.resolution)
    if params.never_upscale:
        target = shrink_to_fit(info.width, info.height, target)
        if target is None:
            raise Rejected("too_small", f"{info.width}x{info.height} is under 64 px with never_upscale set")
    resized, box = place(info.width, info.height, target, params.crop == "random", params.seed, info.digest)
    sample = {
        "id": sample_id, "source": c.source, "path": c.rel, "digest": info.digest, "caption": caption,
        "repeats": source.repeats, "original_size": [info.height, info.width], "size": [target[1], target[0]],
        "resized": resized, "crop_box": box,
    }
    if info.has_alpha:
        sample["background"] = list(params.background)
    if source.role == "prior":  # only then: a dataset without prior images writes what it wrote before
        sample["role"] = "prior"
    if source.missing_caption == "generate" and not caption:  # only then, as for `role`
        sample["written"] = False
    return sample


def _holdout_ids(digests: dict[str, str], fraction: float) -> set[str]:
    """The ids of the images or clips (id -> content digest) held out: the same ones for the same
    fraction, whatever the folder order or the files' names: those of the smallest digests."""
    if fraction == 0 or len(digests) < 2:
        return set()
    k = min(len(digests) - 1, max(1, math.floor(len(digests) * fraction + 0.5)))
    return set(sorted(digests, key=lambda i: (digests[i], i))[:k])
