"""Generating the missing caption records: in batches of the keyed batch_size, each record
`{"json": {"caption": text}}` committed with its shard, a shard every `shard_records` captions (a
killed run keeps its committed shards; the rerun generates only the rest), with progress lines."""
from __future__ import annotations

import json
from pathlib import Path

from lorapipe.cache.errors import UserError
from lorapipe.cache.samples import SampleStore

from ..contract import Log, derived_seed
from ..encode.images import sample_label, upright_image
from ..preprocess.sources import DatasetSource
from ..progress import ProgressLines
from .captioners import load_captioner
from .params import CaptionOptions, CaptionParams


def generate_records(todo: dict[str, dict], params: CaptionParams, model_path: Path, prompt: str,
                     datasets: tuple[DatasetSource, ...], store: SampleStore, options: CaptionOptions,
                     log: Log) -> int:
    """Caption `todo` (record key -> a sample showing its image) into the store; the shards written."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    captioner = load_captioner(model_path, params, device, getattr(torch, params.dtype))
    keys = sorted(todo)
    progress = ProgressLines("caption: generating", len(keys), log, options.progress_every, unit="image")
    pending, shards = {}, 0
    for start in range(0, len(keys), params.batch_size):
        batch = keys[start:start + params.batch_size]
        if params.do_sample:
            torch.manual_seed(derived_seed(params.seed, batch[0]))
        captions = captioner([_image(todo[key], datasets) for key in batch], prompt)
        pending.update({key: {"json": json.dumps({"caption": text}).encode()} for key, text in zip(batch, captions)})
        progress.advance(len(batch))
        if len(pending) >= options.shard_records or start + params.batch_size >= len(keys):
            store.write_shard(pending)
            pending, shards = {}, shards + 1
    return shards


def read_caption(store: SampleStore, key: str) -> str:
    return json.loads(store.read(key, store.index()[key], "json"))["caption"]


def _image(sample: dict, datasets: tuple[DatasetSource, ...]):
    label = sample_label(sample, datasets)
    try:
        image = upright_image(datasets, sample)
    except (OSError, ValueError, SyntaxError) as error:
        raise UserError(f"caption: {label} cannot be decoded ({type(error).__name__}: {error})") from None
    if image is None:
        raise UserError(f"caption: {label} changed since preprocess ran: run the pipeline again")
    return image
