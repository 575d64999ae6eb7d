"""Who encodes what: the missing records as jobs, the encode stage's job (stages/processes/jobs.py) run where
its placement says (stages/processes/placement.py): in one process, or dealt to N processes under
`accelerate launch`, or to a Dask cluster in chunks (dask_executor.py `deal`).

Rank r of N takes every N-th job of the sorted lists, so the split is deterministic and no two
processes encode the same record; each commits its own shards (named by their content digest)
and returns its share of the EncodeResult (the images it could not read), which the job layer
gathers. No collective communication is needed.

Whoever encodes (this process, a rank, a Dask worker) cuts its jobs into shard-sized chunks in
plan order (EncodeJobs.chunks) and commits each chunk as one shard.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Sequence, TypeVar

from lorapipe.cache.object_store import open_sample_store
from lorapipe.cache.samples import SampleStore

from ..contract import Frozen, Log, json_form
from ..encoded import encode_record
from ..processes.jobs import Job, SplitResult, gather, process_device, process_rank
from ..processes.optional_libraries import OPTIONAL
from ..processes.placement import Placement, run_at
from . import EncodeInputs, EncodeOptions, EncodeParams
from .images import decode_failure, placed_image, sample_shape
from .latents import Progress, encode_latents
from .masks import encode_masks

if TYPE_CHECKING:
    from PIL.Image import Image

    from ..families.base import Family, ImageEmbedder, TextEncoder
    from ..preprocess.rows import ImageRow
    from ..preprocess.sources import DatasetSource
    from . import SampleKeys

T = TypeVar("T")
Loader = Callable[[tuple, Callable[[], T]], T]  # ((kind, what identifies the model...), how to load it) -> it



@dataclass(frozen=True)
class EncodeJobs:
    texts: list[tuple[str, str, str, tuple[int, ...]]]  # (text record key, caption, whose caption, the
    # latent job indices of the references its text encoder reads), sorted by key
    latents: list[tuple[str, int, bool]]  # (latent record key, dataset.json index, flipped), by size then key
    reused_latents: int
    masks: list[tuple[str, int, bool]] = ()  # (mask record key, dataset.json index, flipped), by key

    @classmethod
    def plan(cls, dataset: list[ImageRow], keys: SampleKeys, missing: set[str],
             datasets: tuple[DatasetSource, ...]) -> "EncodeJobs":
        texts = {keys.empty: ("", "the empty prompt", ())} if keys.empty else {}
        index = {s.id: i for i, s in enumerate(dataset)}
        for s in dataset:
            own_empty = (keys.own_empty[s.id],) if s.id in keys.own_empty else ()
            for key in (*keys.text.get(s.id, ()), *own_empty):  # a reference image has no caption
                reader = keys.text_references.get(key)
                references = tuple(index[r] for r in keys.references[reader]) if reader else ()
                texts.setdefault(key, (keys.captions[key], s.label(datasets), references))
        latents = {}
        for i, s in enumerate(dataset):
            for flip, table in ((False, keys.latent), (True, keys.latent_flip)):
                if s.id in table:
                    latents[table[s.id]] = (sample_shape(s), i, flip)
        todo = sorted((size, key, i, flip) for key, (size, i, flip) in latents.items() if key in missing)
        masks = {table[s.id]: (i, flip) for i, s in enumerate(dataset)
                 for flip, table in ((False, keys.mask), (True, keys.mask_flip)) if s.id in table}
        return cls(sorted((k, *job) for k, job in texts.items() if k in missing),
                   [(key, i, flip) for _, key, i, flip in todo], len(latents) - len(todo),
                   sorted((key, i, flip) for key, (i, flip) in masks.items() if key in missing))

    def share(self, rank: int, world: int) -> "EncodeJobs":
        return EncodeJobs(self.texts[rank::world], self.latents[rank::world], self.reused_latents,
                          self.masks[rank::world])

    def chunks(self, size: int) -> list["EncodeJobs"]:
        """Consecutive runs of `size` jobs in plan order (texts, then latents, then masks): each
        becomes one shard, whichever executor encodes it, so the shards and the index do not depend on it."""
        skip, skip_masks = len(self.texts), len(self.texts) + len(self.latents)
        return [EncodeJobs(self.texts[start:start + size],
                           self.latents[max(0, start - skip):max(0, start + size - skip)], 0,
                           self.masks[max(0, start - skip_masks):max(0, start + size - skip_masks)])
                for start in range(0, skip_masks + len(self.masks), size)]

    def keys(self) -> list[str]:
        return [job[0] for jobs in (self.texts, self.latents, self.masks) for job in jobs]

    def images(self) -> set[int]:
        """The latent job indices of every image the jobs read (references of texts too)."""
        return {i for _, i, _ in [*self.latents, *self.masks]} | {i for *_, refs in self.texts for i in refs}

    def only(self, keys: set[str]) -> "EncodeJobs":
        return EncodeJobs([t for t in self.texts if t[0] in keys], [j for j in self.latents if j[0] in keys],
                          self.reused_latents, [j for j in self.masks if j[0] in keys])


class EncodeSpec(Frozen):
    params: EncodeParams
    options: EncodeOptions
    inputs: json_form(EncodeInputs)
    jobs: EncodeJobs


class EncodeResult(SplitResult):
    failed: dict[str, str]  # undecodable sample id -> reason


def encode_jobs(jobs: EncodeJobs, dataset: list[ImageRow], params: EncodeParams, inputs: EncodeInputs,
                options: EncodeOptions, rank: int, world: int, log: Log) -> dict[str, str]:
    """Encode this rank's share of the jobs into the sample store; return undecodable sample ids."""
    import torch

    mine = jobs.share(rank, world)
    log(f"encode: process {rank} of {world}: {len(mine.latents)} latents, {len(mine.texts)} text embeddings,"
        f" {torch.get_num_threads()} torch threads")
    share = f" (rank 0's share of {world})" if world > 1 else ""
    progress = Progress(len(mine.latents), jobs.reused_latents, log if rank == 0 else lambda m: None,
                        options.progress_every, share)
    return encode_chunks(mine.chunks(options.shard_records), dataset, params, inputs, options, progress, log)


def encode_chunks(chunks: list[EncodeJobs], dataset: Sequence[ImageRow] | Mapping[int, ImageRow], params: EncodeParams,
                  inputs: EncodeInputs, options: EncodeOptions, progress: Progress, log: Log,
                  loaded: Loader = lambda _, load: load()) -> dict[str, str]:
    """Encode the chunks' jobs, one shard per chunk; `dataset[i]` is the sample of latent job i.
    `loaded` may keep the encoders between calls (a Dask worker loads them once)."""
    import torch

    dtype = getattr(torch, params.dtype)
    device = process_device()
    family = inputs.bound_family()
    buffer = RecordBuffer(open_sample_store(inputs.cache_root), chunks)
    settings = family.text_settings(inputs.model_path, params)
    model = (str(inputs.model_path), inputs.family, tuple(sorted(inputs.model_digests.items())), device)
    text_model = ("text", *model, settings.model_dump_json(), params.dtype)
    failed = encode_texts([t for c in chunks for t in c.texts],
                          lambda: loaded(text_model, lambda: family.text_encoder(inputs.model_path, settings,
                                                                                     dtype, device)),
                          buffer.add, options.batch_size, log, lambda i: (dataset[i], inputs.datasets))
    failed |= encode_latents([(key, dataset[i], flip) for c in chunks for key, i, flip in c.latents], inputs.datasets,
                            lambda: loaded(("latent", *model), lambda: family.load_latent_encoder(inputs.model_path, device)),
                            dtype, buffer.add, options.batch_size, options.num_workers, progress, log,
                            [n for n, c in enumerate(chunks) for _ in c.latents],
                            lambda: loaded(("image", *model), lambda: image_embedder(family, inputs.model_path, device)))
    failed |= encode_masks([(key, dataset[i], flip) for c in chunks for key, i, flip in c.masks], inputs.datasets,
                           family.geometry(inputs.model_path).downsampling, buffer.add, log)
    buffer.flush()
    return failed


def image_embedder(family: Family, model_path: Path, device: str) -> ImageEmbedder | None:
    """The family's image encoder for its conditioning images (None: the denoiser reads no embedding)."""
    condition = family.image_condition
    if condition is None or condition.embedder is None:
        return None
    return condition.embedder(model_path, family.components.image[0], device)


def encode_texts(jobs: list[tuple[str, str, str, tuple[int, ...]]], encoder: Callable[[], TextEncoder],
                 add: Callable[[str, dict[str, bytes]], None], batch_size: int, log: Log,
                 image: Callable[[int], tuple[ImageRow, tuple[DatasetSource, ...]]]) -> dict[str, str]:
    """jobs: (text record key, caption, whose caption, its references' latent job indices) for texts
    not yet in the store; `image(i)`: latent job i's image and the datasets. Return the references
    that could not be read (id -> why): their texts are not encoded."""
    if not jobs:
        return {}
    text_encoder = encoder()
    for _, caption, whose, _ in jobs:
        if text_encoder.too_long(caption):
            log(f"encode: warning: the caption of {whose} is longer than the text encoder's window; it is truncated")
    failed: dict[str, str] = {}
    for start in range(0, len(jobs), batch_size):
        batch, pictures = [], []
        for job in jobs[start:start + batch_size]:
            read = [reference_picture(*image(i), failed) for i in job[3]]
            if all(p is not None for p in read):
                batch.append(job)
                pictures.append(read)
        if not batch:
            continue
        captions = [caption for _, caption, _, _ in batch]
        records = text_encoder(captions, pictures) if any(pictures) else text_encoder(captions)
        for (key, caption, _, _), tensors in zip(batch, records):
            add(key, encode_record(tensors, {"caption": caption}))
    return failed


def reference_picture(reference: ImageRow, datasets: tuple[DatasetSource, ...], failed: dict[str, str]) -> Image | None:
    """A reference image placed as its latent is, for a text encoder that reads it; None (and the
    reason in `failed`) when it cannot be read or changed since preprocess."""
    try:
        picture = placed_image(datasets, reference)
    except (OSError, ValueError, SyntaxError) as e:
        failed[reference.id] = decode_failure(e)
        return None
    if picture is None:
        failed[reference.id] = "changed since preprocess ran (run the pipeline again)"
    return picture


class RecordBuffer:
    """Collects new records and commits each chunk's records as one shard (EncodeJobs.chunks):
    records arrive in plan order, so a record of the next chunk, or the last record of this
    one, closes it (an undecodable image's record never arrives)."""

    def __init__(self, store: SampleStore, chunks: list[EncodeJobs]):
        self.store, self.pending, self.current = store, {}, -1
        self.chunk_of = {key: n for n, chunk in enumerate(chunks) for key in chunk.keys()}
        self.sizes = [len(chunk.keys()) for chunk in chunks]

    def add(self, key: str, record: dict[str, bytes]) -> None:
        if self.chunk_of[key] != self.current:
            self.flush()
            self.current = self.chunk_of[key]
        self.pending[key] = record
        if len(self.pending) == self.sizes[self.current]:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self.store.write_shard(self.pending)
            self.pending = {}


def encode_at(placement: Placement, jobs: EncodeJobs, params: EncodeParams, inputs: EncodeInputs,
              options: EncodeOptions, work_dir: Path, log: Log) -> dict[str, str]:
    """Encode the jobs where `placement` says (stages/processes/placement.py); return the undecodable samples."""
    if placement.processes > 1:
        log(f"encode: {placement.processes} processes, {len(jobs.latents)} latents and {len(jobs.texts)} texts")
    spec = EncodeSpec(params=params, options=options, inputs=inputs, jobs=jobs)
    run_at(placement, Job("encode", spec, work_dir, placement.threads(options.cpu_threads), OPTIONAL,
                          inputs.cache_root), log)
    return gather(work_dir, EncodeResult, placement.processes).failed


def run_job(job: Job[EncodeSpec], log: Log) -> EncodeResult:
    """Encode this rank's share of the job (stages/processes/jobs.py); return what failed."""
    spec = job.spec
    rank, world = process_rank()
    return EncodeResult(failed=encode_jobs(spec.jobs, job_dataset(spec), spec.params, spec.inputs, spec.options, rank,
                                           world, (lambda m: log(f"[rank {rank}] {m}")) if rank else log))


def job_dataset(spec: EncodeSpec) -> list[ImageRow]:
    """The dataset the latent jobs of `spec` index."""
    from ..preprocess import DATASET_FILE
    from ..preprocess.rows import read_rows
    from .references import with_references

    return with_references(read_rows(spec.inputs.preprocess_dir / DATASET_FILE),
                           spec.inputs.bound_family().image_condition)
