"""The cache on object storage, against a local SeaweedFS (benchmarks/seaweed.py): requests and
seconds of the no-op decision and of the incremental encode, and the shard read rate from S3 vs a
local cache folder. Requests are counted at s3fs's S3 client (every GET, PUT, LIST, DELETE).

- object_noop: the store's side of a no-op decision (the four stages' lookups) over synthetic
  caches of 1k, 10k and 100k samples (two records each, 256 records per shard), and what an
  encode pays to learn which records exist (the store's index) on a fresh host and on one that
  has seen the shards before; also the encode artifact's bytes per sample (what grows at 10M).
- object_incremental: the real preprocess and encode stages of the tiny model on generated images
  with cache_dir on S3 and on a local folder, 1% of images added; then the whole no-op decision.
- object_shard_read: records of SD1.5 size read in training order from a local cache folder, from
  S3 through an empty shard cache (downloading) and through a full one.
"""
from __future__ import annotations

import os
import shutil
import time
import uuid
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .common import generated_images, tiny_model
from .seaweed import seaweedfs

BUCKET = "lorapipe-bench"
RECORDS_PER_SHARD = 256


@contextmanager
def counted_requests() -> Iterator[Counter]:
    """Count the S3 requests made in this process meanwhile, by operation."""
    import s3fs

    counts: Counter = Counter()
    original = s3fs.S3FileSystem._call_s3

    async def counting(self, method, *args, **kwargs):
        counts[method] += 1
        return await original(self, method, *args, **kwargs)

    s3fs.S3FileSystem._call_s3 = counting
    try:
        yield counts
    finally:
        s3fs.S3FileSystem._call_s3 = original


@contextmanager
def s3(root: Path) -> Iterator[None]:
    """A fresh SeaweedFS (a killed one's folder does not start again: its master remembers old ports)."""
    folder = root / "seaweedfs"
    shutil.rmtree(folder, ignore_errors=True)
    with seaweedfs(folder, BUCKET):
        yield


def _object_store(name: str, local: Path):
    from lorapipe.cache.object_store import ObjectArtifactStore, ObjectSettings

    return ObjectArtifactStore(f"s3://{BUCKET}/{name}", ObjectSettings(local, 20 << 30, 60))


def _synthetic_cache(store, samples: int) -> list:
    """Shards holding 2 small records per sample, and four artifacts as the stages make them, the
    encode one with a real samples.json and locations/index.json; returns their StageKeys."""
    import json

    from lorapipe.cache.store import Built, StageKey
    from lorapipe.stages.encoded import write_index

    sample_store = store.sample_store()
    keys = [uuid.UUID(int=i).hex + "0" * 8 for i in range(2 * samples)]
    for start in range(0, len(keys), RECORDS_PER_SHARD):
        sample_store.write_shard({k: {"safetensors": b"x" * 64, "json": b"{}"} for k in keys[start:start + RECORDS_PER_SHARD]})
    index = sample_store.index()

    def encode(out: Path, work: Path) -> Built:
        rows = ({"split": "train", "caption": f"a generated image number {i}", "original_size": [64, 64],
                 "crop_box": [0, 0, 64, 64], "resized": [64, 64], "size": [64, 64], "repeats": 1,
                 "latent": keys[2 * i], "text": keys[2 * i + 1]} for i in range(samples))
        write_index(out, {"family": "sd15", "empty_text": keys[1]}, rows,
                    [{"id": f"img{i:07d}.png", "dataset": "data"} for i in range(samples)], index)
        shards = {loc.shard for loc in index.values()}
        return Built(refs={f"samples/{s}.tar": {k: sample_store.shard_meta(s)[k] for k in ("size", "digest")}
                           for s in sorted(shards)})

    def small(out: Path, work: Path) -> Built:
        (out / "result.json").write_text(json.dumps({"samples": samples}))
        return Built()

    stage_keys = [StageKey(stage, {"stage": stage, "samples": samples}) for stage in
                  ("preprocess", "encode", "train", "evaluate")]
    for key in stage_keys:
        store.build(key, encode if key.stage == "encode" else small, {}, log=lambda m: None)
    return stage_keys


def noop(root: Path, sizes=(1_000, 10_000, 100_000)) -> list[dict]:
    rows = []
    with s3(root):
        for samples in sizes:
            name = f"noop-{samples}-{uuid.uuid4().hex[:6]}"
            writer = _object_store(name, root / f"{name}-writer")
            stage_keys = _synthetic_cache(writer, samples)
            fresh = _object_store(name, root / f"{name}-fresh")
            with counted_requests() as lookups:
                started = time.perf_counter()
                assert all(fresh.lookup(k.stage, k.key).hit for k in stage_keys)
                decide = time.perf_counter() - started
            row = {"samples": samples, "shards": len(fresh.objects.list("samples/")) // 2,
                   "decision_requests": sum(lookups.values()), "decision_s": round(decide, 3)}
            for host, store in (("fresh", fresh), ("warm", writer)):
                with counted_requests() as counts:
                    started = time.perf_counter()
                    assert len(store.sample_store().index()) == 2 * samples
                    row[f"index_{host}_s"] = round(time.perf_counter() - started, 3)
                row[f"index_{host}_requests"] = sum(counts.values())
            encoded = fresh.lookup("encode", stage_keys[1].key).artifact.manifest["files"]
            row["encode_bytes_per_sample"] = round(sum(e["size"] for e in encoded.values()) / samples, 1)
            row["shard_index_bytes_per_record"] = round(sum(
                e.size for rel, e in fresh.objects.list("samples/").items() if rel.endswith(".json")) / (2 * samples), 1)
            rows.append(row)
            fresh.objects.delete_prefix("")  # the next size starts from an empty bucket prefix
    return rows


def _decide(config) -> tuple[float, int]:
    """Seconds and requests of deciding that preprocess and encode are hits (keys and lookups)."""
    from lorapipe.flows.steps import STAGES, Context
    from lorapipe.flows.runner import explain

    with counted_requests() as counts:
        started = time.perf_counter()
        ctx = Context(config, log=lambda m: None)
        assert [row["status"] for row in explain(ctx, STAGES[:2])] == ["hit", "hit"]
        ctx.close()
        return time.perf_counter() - started, sum(counts.values())


def incremental(root: Path, sizes=(1_000, 10_000)) -> list[dict]:
    from lorapipe.flows.config import validate_config
    from lorapipe.flows.steps import Context
    from lorapipe.flows.runner import run_stage

    def encode(config) -> tuple[dict, float, int]:
        with counted_requests() as counts:
            started = time.perf_counter()
            ctx = Context(config, log=lambda m: None)
            pre, _ = run_stage(ctx, "preprocess", {})
            upstream = {"preprocess": ctx.store.lookup("preprocess", pre.key).artifact}
            enc, _ = run_stage(ctx, "encode", upstream)
            ctx.close()
            return enc.info, time.perf_counter() - started, sum(counts.values())

    rows = []
    with s3(root):
        for n in sizes:
            base = generated_images(root / f"images-{n}", n)
            for where in ("local", "s3"):
                work = root / f"incremental-{where}-{n}"
                shutil.rmtree(work, ignore_errors=True)
                shutil.copytree(base, work / "data")
                cache = f"s3://{BUCKET}/incremental-{n}-{uuid.uuid4().hex[:6]}" if where == "s3" else work / "cache"
                config = validate_config({
                    "name": f"grow{n}", "cache_dir": cache, "object_store": {"local_dir": work / "local"},
                    "output_dir": work / "out", "model": {"path": tiny_model(root)}, "data": {"path": work / "data"},
                    "preprocess": {"resolution": 64, "holdout_fraction": 0.01}, "encode": {"batch_size": 16},
                    "train": {"max_steps": 1}, "evaluate": {"prompts": ["x"]}}, "benchmark")
                _, first_s, _ = encode(config)
                generated_images(work / "data", n + n // 100)  # 1% more images
                info, seconds, requests = encode(config)
                decide_s, decide_requests = _decide(config)
                rows.append({"images": n, "cache": where, "first_s": round(first_s, 2), "added": n // 100,
                             "second_s": round(seconds, 2), "second_requests": requests,
                             "latents_encoded": info["latents_encoded"], "latents_reused": info["latents_reused"],
                             "noop_decision_s": round(decide_s, 3), "noop_decision_requests": decide_requests})
    return rows


def shard_read(root: Path, samples: int = 512) -> dict:
    """Records of SD1.5 size (fp16 4x64x64 latent, 77x768 text: 150 KB a sample) read in a
    shuffled order, as training reads them."""
    import random

    from lorapipe.cache.samples import SampleStore

    latent, text = os.urandom(2 * 4 * 64 * 64), os.urandom(2 * 77 * 768)
    records = {f"{i:08d}{kind}": {"safetensors": data} for i in range(samples)
               for kind, data in (("l", latent), ("t", text))}
    keys = sorted(records)
    random.Random(0).shuffle(keys)
    megabytes = sum(len(r["safetensors"]) for r in records.values()) / 1e6
    rates = {}
    with s3(root):
        local = SampleStore(root / "read-local")
        writer = _object_store(f"read-{uuid.uuid4().hex[:6]}", root / "read-writer")
        for store in (local, writer.sample_store()):
            names = sorted(records)
            for start in range(0, len(names), RECORDS_PER_SHARD):
                store.write_shard({k: records[k] for k in names[start:start + RECORDS_PER_SHARD]})
        reader_root = root / "read-reader"
        shutil.rmtree(reader_root, ignore_errors=True)
        reader = _object_store(writer.objects.url.rsplit("/", 1)[1], reader_root).sample_store()
        for name, store in (("local_folder", local), ("s3_empty_shard_cache", reader), ("s3_full_shard_cache", reader)):
            index = store.index()
            started = time.perf_counter()
            for key in keys:
                store.read(key, index[key], "safetensors")
            seconds = time.perf_counter() - started
            rates[name] = {"records_s": round(len(keys) / seconds), "mb_s": round(megabytes / seconds, 1)}
    return {"records": len(keys), "mb": round(megabytes, 1), **rates,
            "empty_over_local": round(rates["local_folder"]["records_s"] / rates["s3_empty_shard_cache"]["records_s"], 2),
            "full_over_local": round(rates["local_folder"]["records_s"] / rates["s3_full_shard_cache"]["records_s"], 2)}
