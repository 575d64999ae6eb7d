"""Who encodes what: the missing records as jobs, encoded in this process or dealt to N processes.

    python -m accelerate.commands.launch --config_file ACCELERATE.yaml -m stages.encode.workers JOB.json

(the encode stage writes both files into its work_dir and runs this when num_processes > 1).
Rank r takes every N-th job of the sorted lists, so the split is deterministic and no two
processes encode the same record; each commits its own shards (named by their content digest)
and writes `failed-<rank>.json`. No collective communication is needed.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from cache.fsutil import write_json_atomic
from cache.object_store import open_sample_store
from cache.samples import SampleStore

from ..contract import Log
from ..encoded import encode_record
from ..launching import die_with_parent, reporting_errors, run_streaming, write_accelerate_config
from .images import sample_label
from .latents import Progress, encode_latents

if TYPE_CHECKING:
    from ..families.base import TextEncoder
    from ..preprocess.sources import DatasetSource
    from . import EncodeInputs, EncodeOptions, EncodeParams, SampleKeys


@dataclass(frozen=True)
class EncodeJobs:
    texts: list[tuple[str, str, str]]  # (text record key, caption, whose caption), sorted by key
    latents: list[tuple[str, int, bool]]  # (latent record key, dataset.json index, flipped), by size then key
    reused_latents: int

    @classmethod
    def plan(cls, dataset: list[dict], keys: SampleKeys, missing: set[str],
             datasets: tuple[DatasetSource, ...]) -> "EncodeJobs":
        texts = {keys.empty: ("", "the empty prompt")}
        for s in dataset:
            for key in keys.text[s["id"]]:
                texts.setdefault(key, (keys.captions[key], sample_label(s, datasets)))
        latents = {}
        for i, s in enumerate(dataset):
            for flip, table in ((False, keys.latent), (True, keys.latent_flip)):
                if s["id"] in table:
                    latents[table[s["id"]]] = (tuple(s["size"]), i, flip)
        todo = sorted((size, key, i, flip) for key, (size, i, flip) in latents.items() if key in missing)
        return cls(sorted((k, c, w) for k, (c, w) in texts.items() if k in missing),
                   [(key, i, flip) for _, key, i, flip in todo], len(latents) - len(todo))

    def share(self, rank: int, world: int) -> "EncodeJobs":
        return EncodeJobs(self.texts[rank::world], self.latents[rank::world], self.reused_latents)


def encode_jobs(jobs: EncodeJobs, dataset: list[dict], params: EncodeParams, inputs: EncodeInputs,
                options: EncodeOptions, rank: int, world: int, log: Log) -> dict[str, str]:
    """Encode this rank's share of the jobs into the sample store; return undecodable sample ids."""
    import torch

    mine = jobs.share(rank, world)
    dtype = getattr(torch, params.dtype)
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"
    family = inputs.bound_family()
    buffer = RecordBuffer(open_sample_store(inputs.cache_root), options.shard_records)
    settings = family.text_settings(inputs.model_path, params)
    encode_texts(mine.texts, lambda: family.load_text_encoder(inputs.model_path, settings, dtype, device), buffer.add,
                 options.batch_size, log)
    share = f" (rank 0's share of {world})" if world > 1 else ""
    progress = Progress(len(mine.latents), jobs.reused_latents, log if rank == 0 else lambda m: None,
                        options.progress_every, share)
    failed = encode_latents([(key, dataset[i], flip) for key, i, flip in mine.latents], inputs.datasets,
                            lambda: family.load_latent_encoder(inputs.model_path, device), dtype, buffer.add,
                            options.batch_size, options.num_workers, progress, log)
    buffer.flush()
    return failed


def encode_texts(jobs: list[tuple[str, str, str]], encoder: Callable[[], TextEncoder],
                 add: Callable[[str, dict[str, bytes]], None], batch_size: int, log: Log) -> None:
    """jobs: (text record key, caption, whose caption) for texts not yet in the store."""
    if not jobs:
        return
    text_encoder = encoder()
    for _, caption, whose in jobs:
        if text_encoder.too_long(caption):
            log(f"encode: warning: the caption of {whose} is longer than the text encoder's window; it is truncated")
    for start in range(0, len(jobs), batch_size):
        batch = jobs[start:start + batch_size]
        for (key, caption, _), tensors in zip(batch, text_encoder([c for _, c, _ in batch])):
            add(key, encode_record(tensors, {"caption": caption}))


class RecordBuffer:
    """Collects new records and commits them to the sample store shard by shard."""

    def __init__(self, store: SampleStore, shard_records: int):
        self.store, self.shard_records, self.pending = store, shard_records, {}

    def add(self, key: str, record: dict[str, bytes]) -> None:
        self.pending[key] = record
        if len(self.pending) >= self.shard_records:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self.store.write_shard(self.pending)
            self.pending = {}


def launch_workers(jobs: EncodeJobs, params: EncodeParams, inputs: EncodeInputs, options: EncodeOptions,
                   work_dir: Path, log: Log) -> dict[str, str]:
    """Run the jobs in `options.num_processes` processes under accelerate; merge what failed."""
    (work_dir / "logs").mkdir(parents=True, exist_ok=True)
    for stale in work_dir.glob("failed-*.json"):
        stale.unlink()
    job = work_dir / "encode-job.json"
    job.write_text(json.dumps({
        "params": params.model_dump(mode="json"), "options": options.model_dump(mode="json"),
        "inputs": inputs.to_json(), "texts": jobs.texts, "latents": jobs.latents, "reused": jobs.reused_latents,
    }, sort_keys=True))
    config = write_accelerate_config(work_dir / "accelerate.yaml", options.num_processes)
    threads = max(1, (os.cpu_count() or 1) // options.num_processes)
    log(f"encode: {options.num_processes} processes, {len(jobs.latents)} latents and {len(jobs.texts)} texts")
    run_streaming([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                   "--num_cpu_threads_per_process", str(threads), "-m", "stages.encode.workers", str(job)],
                  work_dir / "logs" / "encode.log", log)
    failed: dict[str, str] = {}
    for rank in range(options.num_processes):
        failed.update(json.loads((work_dir / f"failed-{rank}.json").read_text()))
    return failed


def main(job_path: Path) -> None:
    from . import EncodeInputs, EncodeOptions, EncodeParams
    from ..preprocess import DATASET_FILE

    die_with_parent()
    job = json.loads(job_path.read_text())
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    inputs = EncodeInputs.from_json(job["inputs"])
    jobs = EncodeJobs([tuple(t) for t in job["texts"]], [tuple(t) for t in job["latents"]], job["reused"])
    dataset = json.loads((inputs.preprocess_dir / DATASET_FILE).read_text())["samples"]
    log = (lambda m: print(m, flush=True)) if rank == 0 else (lambda m: print(f"[rank {rank}] {m}", flush=True))
    share = jobs.share(rank, world)
    log(f"encode: process {rank} of {world}: {len(share.latents)} latents, {len(share.texts)} text embeddings")
    with reporting_errors():
        failed = encode_jobs(jobs, dataset, EncodeParams(**job["params"]), inputs, EncodeOptions(**job["options"]),
                             rank, world, log)
    write_json_atomic(job_path.parent / f"failed-{rank}.json", failed)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
