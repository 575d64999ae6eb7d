"""Latent records: the family's VAE posteriors of size-grouped batches, decoded in worker threads."""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cache
from typing import TYPE_CHECKING, Callable, Iterator, TypeVar

from ..contract import Log
from ..families.base import IMAGE_EMBEDS
from ..encoded import encode_record
from ..progress import ProgressLines
from ..preprocess.rows import ImageRow
from .images import ImageCrops, sample_shape, size_batches

if TYPE_CHECKING:
    import torch

    from ..families.base import ImageEmbedder, LatentEncoder
    from ..preprocess.sources import DatasetSource

T = TypeVar("T")


class Progress(ProgressLines):
    """Latents encoded: a line at most every `every` seconds (and at the first and last batch): a
    bar, images/s, ETA, reuse."""

    def __init__(self, total: int, reused: int, log: Log, every: float, what: str = ""):
        super().__init__("encode: latents", total, log, every, unit="img", note=what, tail=f"; {reused} reused")


def halve_on_oom(fn: Callable[[torch.Tensor], T], batch: torch.Tensor, log: Log) -> list[T]:
    """fn(batch) as one call, or, on CUDA out-of-memory, fn over its two halves (recursively)."""
    import torch

    try:
        return [fn(batch)]
    except torch.cuda.OutOfMemoryError:
        if len(batch) == 1:
            raise
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        half = (len(batch) + 1) // 2
        log(f"encode: CUDA out of memory on a batch of {len(batch)}; retrying as {half} + {len(batch) - half}")
        return halve_on_oom(fn, batch[:half], log) + halve_on_oom(fn, batch[half:], log)


def decoded_batches(crops: ImageCrops, batches: list[list[int]], workers: int) -> Iterator[list]:
    """Batches decoded by `workers` threads, at most two per thread in advance of the model. Threads, not
    DataLoader processes: PIL releases the GIL while decoding and resizing, a thread starts at once
    where a spawned worker took seconds to import torch, and forked workers died inside Prefect."""
    if workers == 0:
        yield from ([crops[i] for i in batch] for batch in batches)
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="decode") as pool:
        decoding: deque[Future] = deque()
        for batch in batches:
            decoding.append(pool.submit(lambda b=batch: [crops[i] for i in b]))
            if len(decoding) > 2 * workers:
                yield decoding.popleft().result()
        while decoding:
            yield decoding.popleft().result()


def encode_latents(jobs: list[tuple[str, ImageRow, bool]], datasets: tuple[DatasetSource, ...],
                   encoder: Callable[[], LatentEncoder], dtype: torch.dtype, add: Callable[[str, dict[str, bytes]], None],
                   batch_size: int, num_workers: int, progress: Progress, log: Log,
                   chunks: list[int] | None = None,
                   embedder: Callable[[], ImageEmbedder | None] = lambda: None) -> dict[str, str]:
    """jobs: (latent record key, preprocess sample, flipped), grouped by size; `encoder` loads the
    family's latent encoder (pixels -> posterior mean and std), `embedder` its image encoder, whose
    embedding of a conditioning image's first frame its record also holds. `chunks`: each job's chunk, where
    no batch crosses a chunk's end (a record's bytes depend on its batch: the same batches
    whichever executor encodes the chunks). Returns the samples whose image could not be
    decoded: id -> reason."""
    failed: dict[str, str] = {}
    if not jobs:
        return failed
    import torch

    posterior, embedder = encoder(), cache(embedder)  # the image encoder loaded at its first conditioning image
    groups = chunks or [0] * len(jobs)
    batches = size_batches([(g, *sample_shape(s)) for g, (_, s, _) in zip(groups, jobs)], batch_size)
    crops = ImageCrops(datasets, [s for _, s, _ in jobs], [f for _, _, f in jobs])
    with torch.inference_mode():
        for batch in decoded_batches(crops, batches, num_workers):
            for i, _, reason in (item for item in batch if item[1] is None):
                failed[jobs[i][1].id] = reason
                log(f"encode: skipped {jobs[i][1].label(datasets)}: {reason}")
            good = [(i, pixels) for i, pixels, _ in batch if pixels is not None]
            if good:
                chunks = halve_on_oom(posterior, torch.stack([p for _, p in good]), log)
                mean, std = torch.cat([m for m, _ in chunks]), torch.cat([s for _, s in chunks])
                embeds = condition_embeds([(jobs[i][1], pixels) for i, pixels in good], embedder)
                for row, (i, _) in enumerate(good):
                    key, sample, flip = jobs[i]
                    tensors = {"mean": mean[row], "std": std[row], **embeds.get(row, {})}
                    tensors = {name: t.to(dtype) for name, t in tensors.items()}
                    add(key, encode_record(tensors, {"image": sample.digest, "flip": flip}))
            progress.advance(len(batch))
    return failed


def condition_embeds(batch: list[tuple[ImageRow, torch.Tensor]], embedder: Callable[[], ImageEmbedder | None]
                     ) -> dict[int, dict[str, torch.Tensor]]:
    """The image encoder's embedding of each conditioning image of the batch (its first frame), by row;
    {} where the batch has none or the family embeds none."""
    rows = [row for row, (sample, _) in enumerate(batch) if sample.condition_frames]
    embed = embedder() if rows else None
    if embed is None:
        return {}
    import torch

    embeds = embed(torch.stack([batch[row][1][:, 0] for row in rows]))
    return {row: {IMAGE_EMBEDS: embeds[n]} for n, row in enumerate(rows)}
