"""encode.executor: dask — the plan's chunks (EncodeJobs.chunks) encoded as tasks on a Dask cluster.

The cluster is the one at `encode.dask_address`, or a LocalCluster of `dask_workers` processes
(one task at a time each, on the torch threads of `worker_threads`) that the stage starts and
stops. Each task encodes one chunk into one shard of the shared sample store (a folder every
worker sees at the same path, or the local side of an S3 cache_dir on this host); a worker keeps
the encoders it loaded for the next chunk. When a worker dies, the scheduler runs its chunk again
elsewhere: a shard is committed whole or not at all, so the retry encodes only the chunk's records
that are not committed yet. The parent writes the index.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, TypeVar

from lorapipe.cache.digest import digest_json
from lorapipe.cache.errors import UserError
from lorapipe.cache.object_store import open_sample_store

from .. import optional_libraries
from ..contract import Log
from ..cpu_threads import threads_per_process, torch_threads
from ..launching import environment_kept
from .latents import Progress
from .workers import EncodeJobs, encode_chunks

if TYPE_CHECKING:
    from distributed import Client

    from . import EncodeInputs, EncodeOptions, EncodeParams

T = TypeVar("T")
_models: dict[str, tuple[tuple, object]] = {}  # in a worker process: kind -> (model identity, encoder)
CONNECT_SECONDS = 30


@dataclass(frozen=True)
class ChunkResult:
    failed: dict[str, str]  # undecodable sample id -> reason
    latents: int  # latent jobs the chunk held
    lines: list[str]  # what the worker logged (warnings, skipped images)


def run_on_dask(jobs: EncodeJobs, dataset: list[dict], params: EncodeParams, inputs: EncodeInputs,
                options: EncodeOptions, log: Log) -> dict[str, str]:
    """Encode the jobs on the cluster, one task per chunk; return undecodable sample ids."""
    chunks = jobs.chunks(options.shard_records)
    threads = worker_threads(options)
    with _client(options, log) as client:
        workers = len(client.scheduler_info()["workers"])
        each = f", {threads} torch threads each" if threads else ""
        log(f"encode: {len(chunks)} chunks of up to {options.shard_records} records on {workers} Dask workers{each}")
        progress = Progress(len(jobs.latents), jobs.reused_latents, log, options.progress_every,
                            f" ({workers} Dask workers)")
        futures = [client.submit(encode_chunk, chunk, {i: dataset[i] for _, i, _ in [*chunk.latents, *chunk.masks]},
                                 params, inputs, options, threads,
                                 key=f"encode-chunk-{n:06d}-{digest_json(chunk.keys())[:16]}", pure=False)
                   for n, chunk in enumerate(chunks)]
        return _gather(client, futures, progress, log)


def _gather(client: Client, futures: list, progress: Progress, log: Log) -> dict[str, str]:
    from distributed import as_completed

    failed: dict[str, str] = {}
    for _, result in as_completed(futures, with_results=True):
        for line in result.lines:
            log(line)
        failed.update(result.failed)
        progress.advance(result.latents)
    return failed


def worker_threads(options: EncodeOptions) -> int | None:
    """Torch threads per worker: on the local cluster, by the rule every stage follows
    (stages/cpu_threads.py) for its dask_workers processes; on a cluster at dask_address (other
    machines, started by the user) encode.cpu_threads or the config's, else None: the worker's own."""
    return options.cpu_threads if options.dask_address else threads_per_process(options.cpu_threads,
                                                                                 options.dask_workers)


def encode_chunk(chunk: EncodeJobs, samples: dict[int, dict], params: EncodeParams, inputs: EncodeInputs,
                 options: EncodeOptions, threads: int | None = None) -> ChunkResult:
    """A task: encode the chunk's records not committed yet (an earlier attempt, on a worker that
    died after committing, may have written them) into one shard, on `threads` torch threads
    (None: as many as the worker has)."""
    todo = chunk.only(set(open_sample_store(inputs.cache_root).missing(chunk.keys())))
    lines: list[str] = []
    quiet = Progress(len(todo.latents), 0, lambda m: None, options.progress_every)
    with torch_threads(threads) if threads else nullcontext():
        failed = encode_chunks([todo], samples, params, inputs, options, quiet, lines.append, _loaded)
    return ChunkResult(failed, len(chunk.latents), lines)


def _loaded(identity: tuple, load: Callable[[], T]) -> T:
    """The encoder `identity` names, loaded once per worker process (the last one of each kind kept)."""
    kind = identity[0]
    if kind not in _models or _models[kind][0] != identity:
        _models.pop(kind, None)  # free the old one before loading another
        _models[kind] = (identity, load())
    return _models[kind][1]


@contextmanager
def _client(options: EncodeOptions, log: Log) -> Iterator[Client]:
    try:
        from distributed import Client, LocalCluster
    except ImportError:
        raise UserError("encode.executor: dask needs Dask's distributed package: pip install 'lorapipe[dask]'"
                        " (or pip install distributed), or set executor: local") from None
    if options.dask_address:
        try:
            client = Client(options.dask_address, timeout=CONNECT_SECONDS)
        except (OSError, TimeoutError) as e:
            raise UserError(f"encode.dask_address: no Dask scheduler answered at {options.dask_address} within"
                            f" {CONNECT_SECONDS} s ({e}): start one (dask scheduler) or fix the address") from None
        with client:
            yield client
        return
    log(f"encode: starting a local Dask cluster of {options.dask_workers} worker processes")
    # its workers run only encode's tasks: they hide the optional libraries, which a worker of a cluster
    # at dask_address (long-lived, maybe shared with tasks that use them) must keep
    with environment_kept(), LocalCluster(n_workers=options.dask_workers, threads_per_worker=1, processes=True,
                                          dashboard_address=":0", preload=[optional_libraries.__name__]
                                          ) as cluster, Client(cluster) as client:
        yield client

