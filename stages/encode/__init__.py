"""Encode: pixels -> VAE posteriors and text-encoder outputs, as records in the sample store.

Reads:  the preprocess artifact (dataset.json) and the images it names, the model's latent encoder
        (VAE) and text encoder(s), through its family (stages/families).
Writes: samples.json and locations/index.json (stages/encoded.py), an index into shards of the
        sample store; each sample's latent record(s) (and a horizontally flipped one with `flip`)
        and text record(s) are keyed by what they depend on, so only records that do not exist yet
        are computed (a caption edit encodes one text record, or that sample's caption_variants, and
        no latent). A sample with a loss mask (preprocess's `mask`) also gets a mask record (and a
        mirrored one with `flip`) at latent resolution (stages/encode/masks.py). samples.json's
        header records the family, the encoder components' digests, the text settings and the
        latent normalisation train and evaluate apply. Also logs/report.json (undecodable images).
Key:    these params + the preprocess artifact's digest + the digests of the family's text and
        latent components + what the family resolves from them (resolved_settings: text settings,
        latent normalisation), so a family that changes its hidden layer is a miss, not a stale hit.
Digest: samples.json only: the record keys and what training reads with them, not where the
        records or the images are (a renamed image or a repaired shard reruns encode alone).

A latent record's key: the image's bytes, crop and background, flip, dtype, the VAE's digest. A mask
record's key: the mask's bytes, the image's resize and crop, flip, the VAE's downsampling. A text
record's key: the caption, the family, its text components' digests and every text setting
(encoders, hidden layers, pooled output, max length, padding and template: family.text_settings),
dtype. Image sides must be multiples of the family's pixel multiple (SD 8, Flux 16). With
caption_variants K > 1 (stages/encode/captions.py) a training sample has K text records, each keyed
by its variant caption's text like any caption: the augmentation settings are in the stage's key
(which variants exist), not in the records' keys (what a text encodes to).

The missing records are encoded where the stage's placement says (stages/processes/placement.py, `where`):
with `num_processes` > 1, dealt to that many processes started by `accelerate launch`
(stages/encode/workers.py); each commits its own shards, the parent then writes the one
samples.json. Each record is encoded exactly once. With one process, in the warm process when the
command started one (torch and diffusers imported once for encode, train and evaluate), else in
this process. With `executor: dask`, as shard-sized chunks on a Dask cluster (dask_executor.py):
the same shards, so the same samples.json and index, as in one process.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from lorapipe.cache.digest import digest_json
from lorapipe.cache.errors import UserError
from lorapipe.cache.object_store import open_sample_store
from lorapipe.cache.samples import SampleStore
from lorapipe.cache.store import Built

from .. import families
from ..families.base import ImageCondition
from ..contract import Frozen, Log, OutputFile, library_majors
from ..processes.cpu_threads import usable_cores
from ..encoded import write_index
from ..processes.placement import DaskCluster, Placement, Where, place
from ..preprocess import DATASET_FILE
from ..preprocess.rows import ImageRow, PlacedImage, SampleRow, read_rows
from ..preprocess.sources import DatasetSource
from ..progress import ProgressLines
from .captions import CaptionAugmentation
from .images import ImageCrops
from .masks import mask_key
from .references import reference_id, with_references

VERSION = "5"  # 5: the family, its text settings and latent normalisation in samples.json
OUTPUT_FILES: tuple[OutputFile, ...] = ()  # its index is train's and evaluate's input, not the user's
# in record keys: bump when a record's bytes would change for the same inputs
LATENT_VERSION = "2"  # 2: JPEGs decoded at a reduced scale, resized before turning upright
TEXT_VERSION = "1"

__all__ = ["VERSION", "OUTPUT_FILES", "EncodeParams", "EncodeOptions", "EncodeInputs", "ImageCrops", "latent_key",
           "resolved_settings", "text_key", "run", "where"]


class EncodeParams(families.TextOptions, CaptionAugmentation):
    """The record dtype, flips, the text options the family resolves into its text settings, and the
    caption variants of training samples."""

    dtype: Literal["float32", "float16", "bfloat16"] = Field(
        "float32", description="the dtype latent and text records are computed and stored in (float16 and"
        " bfloat16 halve their disk)")
    flip: bool = Field(False, description="also encode each image mirrored, as its own latent record")


class EncodeOptions(Frozen):
    batch_size: int = Field(8, gt=0, description="images per VAE call (halved on CUDA out-of-memory)")
    num_workers: int = Field(default_factory=lambda: max(1, min(16, usable_cores() - 1)), ge=0,
                             description="threads decoding images before the VAE needs them (0: in the VAE's thread);"
                             " default: the usable cores less one, at least 1, at most 16")
    shard_records: int = Field(256, gt=0, description="records per shard (a crash loses at most one shard)")
    num_processes: int = Field(1, ge=1, description="encode processes under accelerate launch (one per GPU),"
                               " used when more than one batch of latents is missing")
    progress_every: float = Field(10.0, ge=0, description="seconds between progress lines")
    executor: Literal["local", "dask"] = Field("local", description="local: this process (or num_processes under"
                                               " accelerate); dask: shard-sized chunks as tasks on a Dask cluster")
    dask_address: str | None = Field(None, description="the Dask scheduler to use (tcp://host:8786); default: a"
                                     " local cluster of dask_workers processes, started and stopped by the stage")
    dask_workers: int = Field(2, ge=1, description="worker processes of the local Dask cluster (one task at a"
                              " time each)")
    cpu_threads: int | None = Field(None, gt=0, description="torch threads per encode process (a Dask worker's too);"
                                    " default: the config's cpu_threads")

    @model_validator(mode="after")
    def _one_executor(self) -> "EncodeOptions":
        if self.executor != "dask" and self.dask_address:
            raise ValueError("dask_address is set but executor is local: set executor: dask, or remove dask_address")
        if self.executor == "dask" and self.num_processes > 1:
            raise ValueError("num_processes > 1 runs accelerate processes, executor: dask runs Dask workers:"
                             " choose one (num_processes: 1, or executor: local)")
        return self


@dataclass(frozen=True)
class EncodeInputs:
    preprocess_dir: Path
    datasets: tuple[DatasetSource, ...]
    cache_root: Path
    model_path: Path  # a diffusers folder
    family: str  # its family's name
    model_digests: dict[str, str]  # of the family's text and latent components

    def bound_family(self) -> families.Family:
        return families.for_model(self.model_path, self.family)

    def to_json(self) -> dict:
        return {"preprocess_dir": str(self.preprocess_dir), "cache_root": str(self.cache_root),
                "datasets": [d.model_dump(mode="json") for d in self.datasets], "model_path": str(self.model_path),
                "family": self.family, "model_digests": self.model_digests}

    @classmethod
    def from_json(cls, v: dict) -> "EncodeInputs":
        return cls(Path(v["preprocess_dir"]), tuple(DatasetSource(**d) for d in v["datasets"]),
                   Path(v["cache_root"]), Path(v["model_path"]), v["family"], v["model_digests"])


def latent_key(sample: ImageRow, params: EncodeParams, vae_digest: str, flip: bool = False) -> str:
    return digest_json({**sample.pixel_identity(), "flip": flip, "dtype": params.dtype, "vae": vae_digest,
                        "version": LATENT_VERSION, "libs": library_majors("torch", "diffusers")})[:40]


def resolved_settings(family: families.Family, model_path: Path, params: EncodeParams) -> dict:
    """What the family resolves from the model and the params for every record (its text settings,
    its latent normalisation): in the encode stage's key, so that a family whose hidden layer,
    template or normalisation changes is a miss even with the same params, and in samples.json."""
    return {"text": family.text_settings(model_path, params).model_dump(mode="json"),
            "normalisation": family.latent_normalisation(model_path).model_dump(mode="json")}


def text_ingredients(family: families.Family, settings: Frozen, inputs: EncodeInputs) -> dict:
    """What every text record's key holds of the model: the family, its text components' digests
    and its text settings."""
    return {"family": family.name, "encoders": {k: inputs.model_digests[k] for k in sorted(family.components.text)},
            "text": settings.model_dump(mode="json")}


def text_key(caption: str, params: EncodeParams, ingredients: dict, references: tuple[PlacedImage, ...] = ()) -> str:
    """`references`: the placed reference images a vision-language text encoder reads with the
    caption (Family.text_takes_references), by their pixel identity."""
    images = {"references": [r.pixel_identity() for r in references]} if references else {}
    return digest_json({"caption": caption, **ingredients, **images, "dtype": params.dtype, "version": TEXT_VERSION,
                        "libs": library_majors("torch", "transformers")})[:40]


@dataclass(frozen=True)
class SampleKeys:
    """Every record key the encode artifact points to, per sample id (masks: masked samples only)."""

    latent: dict[str, str]
    latent_flip: dict[str, str]
    text: dict[str, tuple[str, ...]]  # its caption's record, or a training sample's caption variants'
    captions: dict[str, str]  # text record key -> the caption it encodes
    empty: str | None  # the empty prompt's record; None where the text encoder reads references (own_empty)
    mask: dict[str, str] = field(default_factory=dict)
    mask_flip: dict[str, str] = field(default_factory=dict)
    references: dict[str, tuple[str, ...]] = field(default_factory=dict)  # sample id -> its references' ids
    # (encode/references.py), whose latent keys `latent` and `latent_flip` hold
    text_references: dict[str, str] = field(default_factory=dict)  # text record key -> whose references it
    # reads (a sample id; Family.text_takes_references)
    own_empty: dict[str, str] = field(default_factory=dict)  # sample id -> its empty prompt's record, read with
    # its references (caption dropout, for a text encoder that reads them)

    @classmethod
    def of(cls, dataset: list[SampleRow], params: EncodeParams, vae_digest: str, text: dict,
           mask_factor: int, log: Log = lambda line: None, every: float = 10.0,
           text_reads_references: bool = False, condition: ImageCondition | None = None,
           condition_digest: str = "") -> "SampleKeys":
        """`text`: text_ingredients; `mask_factor`: image pixels per latent pixel;
        `text_reads_references`: the family's text encoder reads each sample's references;
        `condition`: an image-to-video model's conditioning image (the references), whose records
        are keyed with `condition_digest` (Components.condition_digest). Variant
        captions are made and keyed one at a time, with a progress line every `every` seconds once it
        takes that long (many samples times caption_variants)."""
        captions, texts, readers, own_empty = {}, {}, {}, {}
        progress = ProgressLines("encode: keying samples", len(dataset), log, every, unit="sample", from_start=False)
        for s in dataset:
            keys = []
            references = (s.references or ()) if text_reads_references else ()
            for caption in params.captions(s.caption, s.digest) if s.split == "train" else (s.caption,):
                keys.append(text_key(caption, params, text, references))
                captions[keys[-1]] = caption
                if references:
                    readers[keys[-1]] = s.id
            texts[s.id] = tuple(keys)
            if references:
                own_empty[s.id] = text_key("", params, text, references)
                captions[own_empty[s.id]], readers[own_empty[s.id]] = "", s.id
            progress.advance()
        empty = None if text_reads_references else text_key("", params, text)
        masked = [s for s in dataset if s.mask is not None]
        images = with_references(dataset, condition)

        def model(s: ImageRow) -> str:
            return condition_digest if s.condition_frames else vae_digest

        return cls({s.id: latent_key(s, params, model(s)) for s in images},
                   {s.id: latent_key(s, params, model(s), True) for s in images} if params.flip else {},
                   texts, {**captions, **({empty: ""} if empty else {})}, empty,
                   {s.id: mask_key(s, mask_factor) for s in masked},
                   {s.id: mask_key(s, mask_factor, True) for s in masked} if params.flip else {},
                   {s.id: tuple(reference_id(s.id, k) for k in range(len(s.references)))
                    for s in dataset if s.references is not None}, readers, own_empty)

    def of_sample(self, sample_id: str) -> list[str]:
        images = (sample_id, *self.references.get(sample_id, ()))
        return [*(table[image] for image in images for table in (self.latent, self.latent_flip)
                  if image in table),
                *(table[sample_id] for table in (self.mask, self.mask_flip, self.own_empty) if sample_id in table),
                *self.text[sample_id]]

    def reference_latents(self, sample_id: str, flip: bool = False) -> list[str]:
        """Its references' latent keys (mirrored ones with `flip`), in order."""
        table = self.latent_flip if flip else self.latent
        return [table[image] for image in self.references.get(sample_id, ())]

    def latents(self) -> set[str]:
        return {*self.latent.values(), *self.latent_flip.values()}

    def texts(self) -> set[str]:
        return {*(key for keys in self.text.values() for key in keys), *self.own_empty.values(),
                *([self.empty] if self.empty else [])}

    def masks(self) -> set[str]:
        return {*self.mask.values(), *self.mask_flip.values()}

    def all(self) -> set[str]:
        return self.latents() | self.texts() | self.masks()


def run(params: EncodeParams, inputs: EncodeInputs, out_dir: Path, work_dir: Path,
        options: EncodeOptions, log: Log = print, placement: Placement | None = None) -> Built:
    """`placement`: where the records are encoded (the plan's; default: what `where` says)."""
    from .workers import EncodeJobs, encode_at

    dataset = read_rows(inputs.preprocess_dir / DATASET_FILE)
    family = inputs.bound_family()
    _check_dataset(dataset, family, inputs)
    keys = SampleKeys.of(dataset, params, family.components.latent_digest(inputs.model_digests),
                         text_ingredients(family, family.text_settings(inputs.model_path, params), inputs),
                         family.geometry(inputs.model_path).downsampling, log, options.progress_every,
                         family.text_takes_references, family.image_condition,
                         family.components.condition_digest(inputs.model_digests))
    store = open_sample_store(inputs.cache_root)
    _add_member_digests(store, keys, log)
    images = with_references(dataset, family.image_condition)  # what latent jobs index
    jobs = EncodeJobs.plan(images, keys, set(store.missing(keys.all())), inputs.datasets)
    masks = f", {len(jobs.masks)} loss masks" if jobs.masks else ""
    log(f"encode: {len(jobs.latents)} latents and {len(jobs.texts)} text embeddings{masks} to encode,"
        f" {jobs.reused_latents} latents reused")
    placement = (placement or place(where(options))).sized(len(jobs.latents))
    failed = encode_at(placement, jobs, params, inputs, options, work_dir, log) if jobs.keys() else {}
    failed_latents = sum(1 for _, i, _ in jobs.latents if images[i].id in failed)
    images_by_id = {s.id: s for s in images}
    unpaired = _unpaired(dataset, images_by_id, keys, failed, inputs.datasets)
    undecodable = {**{s.label(inputs.datasets): failed[s.id] for s in images if s.id in failed},
                   **{images_by_id[i].label(inputs.datasets): why for i, why in unpaired.items()}}
    failed = {**failed, **unpaired}
    usable = [s for s in dataset if s.id not in failed]
    if not usable:
        first = next(iter(undecodable.items()))
        raise ValueError(f"encode: none of the {len(dataset)} images could be decoded; the first, {first[0]}: {first[1]}")
    refs = _write_index(out_dir, usable, keys, open_sample_store(inputs.cache_root), inputs.datasets,
                        _index_header(params, family, inputs, keys))
    (out_dir / "logs").mkdir()
    (out_dir / "logs" / "report.json").write_text(json.dumps({"undecodable": undecodable}, indent=1, sort_keys=True))
    counts = {
        "latents_encoded": len(jobs.latents) - failed_latents, "latents_reused": jobs.reused_latents,
        "texts_encoded": len(jobs.texts), "texts_reused": len(keys.texts()) - len(jobs.texts),
        "masks_encoded": sum(1 for _, i, _ in jobs.masks if dataset[i].id not in failed),
        "masks_reused": len(keys.masks()) - len(jobs.masks),
        "undecodable": len(undecodable), "processes": placement.processes,
    }
    log("encode: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    sizes = dict(sorted(Counter(f"{s.size[1]}x{s.size[0]}" for s in usable).items()))
    return Built(info={**counts, "sizes": sizes}, refs=refs)


def _check_dataset(dataset: list[SampleRow], family: families.Family, inputs: EncodeInputs) -> None:
    """Refuse what the model cannot take (before anything is encoded): image sides, window lengths,
    references per target, still images for an image-to-video model."""
    check_sizes(dataset, family.geometry(inputs.model_path).pixel_multiple, family.label)
    check_frames(dataset, family, inputs.model_path, inputs.datasets)
    families.check_references(family, max(len(s.references or ()) for s in dataset))
    check_conditioned(dataset, family, inputs.datasets)


def _unpaired(dataset: list[SampleRow], images: dict[str, ImageRow], keys: SampleKeys, failed: dict[str, str],
              datasets: tuple[DatasetSource, ...]) -> dict[str, str]:
    """The edit pairs whose reference cannot be decoded (id -> why): left out with it, never trained
    unpaired."""
    unpaired = {}
    for s in dataset:
        broken = next((images[r] for r in keys.references.get(s.id, ()) if r in failed), None)
        if broken is not None and s.id not in failed:
            unpaired[s.id] = f"its reference {broken.label(datasets)} cannot be decoded"
    return unpaired


def _index_header(params: EncodeParams, family: families.Family, inputs: EncodeInputs, keys: SampleKeys) -> dict:
    """samples.json's header: the family, the encoders' digests, the text and caption settings and
    the latent normalisation train and evaluate apply."""
    return {
        "family": family.name, "dtype": params.dtype, "models": inputs.model_digests,
        "text_options": families.TextOptions(**params.model_dump(include=set(families.TextOptions.model_fields))
                                             ).model_dump(mode="json"),
        **resolved_settings(family, inputs.model_path, params),
        "empty_text": keys.empty, "flip": params.flip, **_caption_header(params),
    }


def where(options: EncodeOptions) -> Where:
    """Where encode's job runs (stages/processes/placement.py): on a Dask cluster with executor: dask; else
    num_processes under accelerate when more than one batch of latents is missing, else one process."""
    if options.executor == "dask":
        return Where(dask=DaskCluster(options.dask_address, options.dask_workers))
    return Where(options.num_processes, one_process_up_to=options.batch_size)


def _caption_header(params: EncodeParams) -> dict:
    """The caption settings for samples.json's header, where they made variants (absent otherwise,
    so an encode without them writes what it wrote before they existed)."""
    settings = {name: getattr(params, name) for name in CaptionAugmentation.model_fields}  # defaults too
    return {"caption_augmentation": settings} if params.caption_variants > 1 else {}


def _add_member_digests(store: SampleStore, keys: SampleKeys, log: Log) -> None:
    """Shards holding needed records but written before record digests existed are checked
    once and get them (a damaged one is removed, so its records are encoded again)."""
    completed, removed = store.add_member_digests(keys.all())
    for shard, problem in removed:
        log(f"encode: shard {shard} {problem}; removed, its records are encoded again")
    if completed:
        log(f"encode: recorded the record digests of {completed} shards written by an older lorapipe")


def check_sizes(dataset: list[SampleRow], multiple: int, label: str) -> None:
    """Refuse image sides the model cannot take (before anything is encoded)."""
    odd = next((s for s in dataset if s.size[0] % multiple or s.size[1] % multiple), None)
    if odd is not None:
        raise UserError(f"preprocess.resolution / bucket_sizes: {label} needs image sides that are multiples of"
                        f" {multiple} px, but images are cropped to {odd.size[1]}x{odd.size[0]}: choose"
                        f" a resolution that is a multiple of {multiple}")


def check_conditioned(dataset: list[SampleRow], family: families.Family,
                      datasets: tuple[DatasetSource, ...]) -> None:
    """Refuse, for an image-to-video model, a still image: only a clip window has a conditioning image."""
    still = next((s for s in dataset if family.image_condition and not s.references), None)
    if still is not None:
        raise UserError(f"data.datasets: {still.label(datasets)} is an image, but {family.label} trains image-to-video"
                        " on clips (each window conditioned on an image): remove it, or train a text-to-video model")


def check_frames(dataset: list[SampleRow], family: families.Family, model_path: Path,
                 datasets: tuple[DatasetSource, ...]) -> None:
    """Refuse clip windows of a length the model cannot take (before anything is encoded)."""
    for s in dataset:
        problem = family.frames_problem(model_path, s.frame_count)
        if problem:
            raise UserError(f"preprocess.video.num_frames / frame_buckets: {problem}; {s.label(datasets)} has"
                            f" a window of {s.frame_count} frames")


def _reference_entries(keys: SampleKeys, sample_id: str, flip: bool) -> dict:
    """An edit pair's reference latent keys (absent for a sample without references)."""
    if sample_id not in keys.references:
        return {}
    mirrored = {"references_flip": keys.reference_latents(sample_id, True)} if flip else {}
    return {"references": keys.reference_latents(sample_id), **mirrored}


def _write_index(out_dir: Path, dataset: list[SampleRow], keys: SampleKeys, store: SampleStore,
                 datasets: tuple[DatasetSource, ...], header: dict) -> dict:
    """Write samples.json (in record-key order, after `header`) and locations/index.json; return the
    shards they point into as artifact refs (size, digest)."""
    index = store.index()
    ordered = sorted(dataset, key=lambda s: (keys.latent[s.id], keys.text[s.id][0]))

    def sample_entry(s: SampleRow) -> dict:
        flip = {"latent_flip": keys.latent_flip[s.id]} if header["flip"] else {}
        texts = keys.text[s.id]
        variants = {"text_variants": list(texts), "caption_variants": [keys.captions[k] for k in texts]
                    } if len(texts) > 1 else {}
        masks = {name: table[s.id] for name, table in (("mask", keys.mask), ("mask_flip", keys.mask_flip))
                 if s.id in table}
        return {
            "split": s.split, "caption": s.caption, "original_size": s.original_size,
            "crop_box": s.crop_box, "resized": s.resized, "size": s.size, "repeats": s.repeats,
            # a clip's window: its frames and the frame rate they were sampled at (absent: an image)
            **({"frames": s.frame_count, "fps": s.fps} if s.is_clip else {}),
            "latent": keys.latent[s.id], "text": texts[0], **variants, **flip, **masks,
            **({"role": s.role} if s.role else {}),  # a prior sample's (absent: train, as before)
            **_reference_entries(keys, s.id, header["flip"]),
            **({"empty_text": keys.own_empty[s.id]} if s.id in keys.own_empty else {}),
        }

    used = sorted({keys.empty} - {None} | {k for s in ordered for k in keys.of_sample(s.id)})
    write_index(out_dir, header, map(sample_entry, ordered), [{"id": s.id, "dataset": datasets[s.source].label} for s in ordered],
        {key: index[key] for key in used})
    return store.refs(index[key].shard for key in used)
