"""encode.executor: dask — the task each of the job's chunks (EncodeJobs.chunks) is on a Dask cluster.

The encode stage's placement is then a DaskCluster (stages/processes/placement.py): the cluster at
`encode.dask_address`, or a local one of `dask_workers` processes that the stage starts and stops;
`deal` hands it the chunks. Each task encodes one chunk into one shard of
the shared sample store (a folder every worker sees at the same path, or the local side of an S3
cache_dir on this host); a worker keeps the encoders it loaded for the next chunk. When a worker
dies, the scheduler runs its chunk again elsewhere: a shard is committed whole or not at all, so
the retry encodes only the chunk's records that are not committed yet. The parent writes the index.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, TypeVar

from lorapipe.cache.digest import digest_json
from lorapipe.cache.object_store import open_sample_store

from ..contract import Log
from ..processes.jobs import Job
from .latents import Progress
from .workers import EncodeJobs, EncodeResult, EncodeSpec, encode_chunks, job_dataset

if TYPE_CHECKING:
    from ..processes.placement import DaskPool
    from ..preprocess.rows import ImageRow
    from . import EncodeInputs, EncodeOptions, EncodeParams

T = TypeVar("T")
_models: dict[str, tuple[tuple, object]] = {}  # in a worker process: kind -> (model identity, encoder)


@dataclass(frozen=True)
class ChunkResult:
    failed: dict[str, str]  # undecodable sample id -> reason
    latents: int  # latent jobs the chunk held
    lines: list[str]  # what the worker logged (warnings, skipped images)


def deal(job: Job[EncodeSpec], pool: DaskPool, log: Log) -> EncodeResult:
    """Encode the job as shard-sized chunks, each a task of `pool` (executor: dask); return what
    failed, as one process does."""
    params, inputs, options, jobs = job.spec.params, job.spec.inputs, job.spec.options, job.spec.jobs
    dataset = job_dataset(job.spec)
    chunks = jobs.chunks(options.shard_records)
    log(f"encode: {len(chunks)} chunks of up to {options.shard_records} records on {pool.describe()}")
    progress = Progress(len(jobs.latents), jobs.reused_latents, log, options.progress_every,
                        f" ({pool.workers} Dask workers)")
    tasks = [(f"encode-chunk-{n:06d}-{digest_json(chunk.keys())[:16]}",
              (chunk, {i: dataset[i] for i in chunk.images()}, params, inputs, options))
             for n, chunk in enumerate(chunks)]
    failed: dict[str, str] = {}
    for result in pool.map(encode_chunk, tasks):
        for line in result.lines:
            log(line)
        failed.update(result.failed)
        progress.advance(result.latents)
    return EncodeResult(failed=failed)


def encode_chunk(chunk: EncodeJobs, samples: dict[int, ImageRow], params: EncodeParams, inputs: EncodeInputs,
                 options: EncodeOptions) -> ChunkResult:
    """A task: encode the chunk's records not committed yet (an earlier attempt, on a worker that
    died after committing, may have written them) into one shard."""
    todo = chunk.only(set(open_sample_store(inputs.cache_root).missing(chunk.keys())))
    lines: list[str] = []
    quiet = Progress(len(todo.latents), 0, lambda m: None, options.progress_every)
    failed = encode_chunks([todo], samples, params, inputs, options, quiet, lines.append, _loaded)
    return ChunkResult(failed, len(chunk.latents), lines)


def _loaded(identity: tuple, load: Callable[[], T]) -> T:
    """The encoder `identity` names, loaded once per worker process (the last one of each kind kept)."""
    kind = identity[0]
    if kind not in _models or _models[kind][0] != identity:
        _models.pop(kind, None)  # free the old one before loading another
        _models[kind] = (identity, load())
    return _models[kind][1]
