"""Generating the missing caption records: the sorted record keys cut into batches of the keyed
batch_size (the same batches whatever the process count: a sampled caption is seeded per batch by
its first key), each record `{"json": {"caption": text}}` committed with its shard, a shard every
`shard_records` captions (a killed run keeps its committed shards; the rerun generates only the
rest), with progress lines. An image that cannot be read is left out, with a report row, never
raised: the caption stage leaves it to encode, which reports it and trains without it."""
from __future__ import annotations

import json
from pathlib import Path

from lorapipe.cache.samples import SampleStore

from ..contract import Log, derived_seed
from ..encode.images import sample_label, upright_image
from ..jobs import process_device
from ..preprocess.sources import DatasetSource
from ..progress import ProgressLines
from .captioners import load_captioner
from .params import CaptionOptions, CaptionParams


def batches(keys: list[str], size: int) -> list[list[str]]:
    """The sorted `keys` in batches of `size`: one generate() call each."""
    ordered = sorted(keys)
    return [ordered[start:start + size] for start in range(0, len(ordered), size)]


def generate_records(batched: list[list[str]], todo: dict[str, dict], params: CaptionParams, model_path: Path,
                     prompt: str, datasets: tuple[DatasetSource, ...], store: SampleStore, options: CaptionOptions,
                     log: Log, share: str = "") -> dict[str, dict]:
    """Caption the images of `batched` (record keys; `todo`: record key -> a sample showing its image)
    into the store; return the images left out: record key -> their report row."""
    import torch

    captioner = load_captioner(model_path, params, process_device(), getattr(torch, params.dtype))
    progress = ProgressLines("caption: generating", sum(map(len, batched)), log, options.progress_every,
                             unit="image", tail=share)
    pending, left_out = {}, {}
    for n, batch in enumerate(batched):
        images = {key: _image(key, todo[key], datasets, left_out) for key in batch}
        readable = [key for key in batch if images[key] is not None]
        if params.do_sample:
            torch.manual_seed(derived_seed(params.seed, batch[0]))
        captions = captioner([images[key] for key in readable], prompt) if readable else []
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


def _image(key: str, sample: dict, datasets: tuple[DatasetSource, ...], left_out: dict[str, dict]):
    """The sample's image, upright and whole; None, and its report row in `left_out[key]`, when it
    cannot be decoded or changed since preprocess."""
    path = sample_label(sample, datasets)
    try:
        image = upright_image(datasets, sample)
    except (OSError, ValueError, SyntaxError) as error:
        left_out[key] = {"path": path, "reason": "undecodable",
                                      "detail": f"cannot be decoded ({type(error).__name__}: {error})"}
        return None
    if image is None:
        left_out[key] = {"path": path, "reason": "changed", "detail": "changed since preprocess ran"
                                      " (run the pipeline again)"}
    return image
