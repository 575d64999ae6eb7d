"""Generating the missing caption records: the sorted record keys cut into batches of the keyed
batch_size (the same batches whatever the process count: a sampled caption is seeded per batch by
its first key), each record `{"json": {"caption": text}}` committed with its shard, a shard every
`shard_records` captions (a killed run keeps its committed shards; the rerun generates only the
rest), with progress lines; the next batch's images are decoded in threads while generate()
runs. An image that cannot be read is left out, with a report row, never
raised: the caption stage leaves it to encode, which reports it and trains without it."""
from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from lorapipe.cache.samples import SampleStore

from ..contract import Log, derived_seed
from ..encode.images import upright_image
from ..processes.jobs import process_device
from ..preprocess.rows import SampleRow
from ..preprocess.sources import DatasetSource
from ..progress import ProgressLines
from .captioners import load_captioner
from .params import CaptionOptions, CaptionParams

DECODE_THREADS = 4  # the next batch's images, decoded while generate() runs


def batches(keys: list[str], size: int) -> list[list[str]]:
    """The sorted `keys` in batches of `size`: one generate() call each."""
    ordered = sorted(keys)
    return [ordered[start:start + size] for start in range(0, len(ordered), size)]


def generate_records(batched: list[list[str]], todo: dict[str, dict], params: CaptionParams, model_path: Path,
                     prompt: str, datasets: tuple[DatasetSource, ...], store: SampleStore, options: CaptionOptions,
                     log: Log, share: str = "") -> dict[str, dict]:
    """Caption the images of `batched` (record keys; `todo`: record key -> a sample showing its image,
    as a dataset.json row) into the store; return the images left out: record key -> their report row."""
    import torch

    captioner = load_captioner(model_path, params, process_device(), getattr(torch, params.dtype))
    progress = ProgressLines("caption: generating", sum(map(len, batched)), log, options.progress_every,
                             unit="image", tail=share)
    pending, left_out = {}, {}
    for n, (batch, decoded) in enumerate(_decoded(batched, todo, datasets)):
        left_out.update({key: row for key, (_, row) in decoded.items() if row})
        readable = [key for key in batch if decoded[key][0] is not None]
        if params.do_sample:
            torch.manual_seed(derived_seed(params.seed, batch[0]))
        captions = captioner([decoded[key][0] for key in readable], prompt) if readable else []
        pending.update({key: {"json": json.dumps({"caption": text}).encode()} for key, text in zip(readable, captions)})
        progress.advance(len(batch))
        if pending and (len(pending) >= options.shard_records or n == len(batched) - 1):
            store.write_shard(pending)
            pending = {}
    for row in left_out.values():
        log(f"caption: {row['path']}: {row['detail']}; left out of captioning (encode reports it and trains without it)")
    return left_out


def read_caption(store: SampleStore, key: str) -> str:
    return json.loads(store.read(key, store.index()[key], "json"))["caption"]


def _decoded(batched: list[list[str]], todo: dict[str, dict], datasets: tuple[DatasetSource, ...]
             ) -> Iterator[tuple[list[str], dict[str, tuple]]]:
    """Each batch with its images (record key -> `_image`'s pair), the next batch decoded in threads
    while the caller generates this one's captions (decoding releases the GIL)."""
    with ThreadPoolExecutor(DECODE_THREADS) as pool:
        def submit(batch: list[str]) -> dict[str, Future]:
            return {key: pool.submit(_image, SampleRow.model_validate(todo[key]), datasets) for key in batch}

        ahead = submit(batched[0]) if batched else {}
        for n, batch in enumerate(batched):
            current, ahead = ahead, submit(batched[n + 1]) if n + 1 < len(batched) else {}
            yield batch, {key: future.result() for key, future in current.items()}


def _image(sample: SampleRow, datasets: tuple[DatasetSource, ...]) -> tuple:
    """The sample's image, upright and whole, and None; or None and its report row when it cannot
    be decoded or changed since preprocess."""
    path = sample.label(datasets)
    try:
        image = upright_image(datasets, sample)
    except (OSError, ValueError, SyntaxError) as error:
        return None, {"path": path, "reason": "undecodable",
                      "detail": f"cannot be decoded ({type(error).__name__}: {error})"}
    if image is None:
        return None, {"path": path, "reason": "changed", "detail": "changed since preprocess ran (run the pipeline again)"}
    return image, None
