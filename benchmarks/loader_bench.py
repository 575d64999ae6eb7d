"""Train's loader at full-size record shapes: samples/s of preparing micro-batches (read records
from the shards, sample the posterior, noise, timesteps) with 0, 1 and 2 loader threads.

The records are synthetic but shaped and typed as the presets write them: SD1.5 at 512 px (latent
mean and std 4x64x64 in float16, text 77x768) and SDXL at 1024 px (4x128x128 in bfloat16, text
77x2048 + pooled 1280), batch 8 and 4. Training on a GPU must consume fewer than a tenth of these
rates for the loader to meet the ">= 10x" goal; with threads the preparation also leaves the
step's critical path.

Every record read is checked against its blake3 digest; `verify_ms_per_batch` is that check
alone (hashing the bytes of a micro-batch's latents, texts and the empty prompt, already in
memory), and its share of preparing the micro-batch inline.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from .common import tiny_model

if TYPE_CHECKING:
    from lorapipe.stages.encoded import EncodedData
    from lorapipe.stages.train.data import BatchPlan

SETTINGS = {  # family: (latent side, latent dtype, text dims, pooled dim, batch)
    "sd15-512": ("sd15", 64, "float16", 768, None, 8),
    "sdxl-1024": ("sdxl", 128, "bfloat16", 2048, 1280, 4),
}
SAMPLES, SHARD_RECORDS, BATCHES = 64, 32, 48


def synthetic_encoded(out: Path, setting: str) -> Path:
    """An encode artifact of SAMPLES random records with the setting's shapes, in out/cache."""
    import torch

    from lorapipe.cache.samples import SampleStore
    from lorapipe.stages.encoded import encode_record, write_index

    family, side, dtype, text_dim, pooled, _ = SETTINGS[setting]
    store, rng = SampleStore(out / "cache"), torch.Generator().manual_seed(0)
    randn = lambda *shape: torch.randn(shape, generator=rng).to(getattr(torch, dtype))  # noqa: E731
    text = lambda: {"hidden_states": randn(77, text_dim), **({"pooled": randn(pooled)} if pooled else {})}  # noqa: E731
    records = {f"latent{i:04d}": encode_record({"mean": randn(4, side, side), "std": randn(4, side, side).abs()}, {})
               for i in range(SAMPLES)}
    records |= {f"text{i:04d}": encode_record(text(), {}) for i in range(SAMPLES + 1)}
    keys = sorted(records)
    for start in range(0, len(keys), SHARD_RECORDS):
        store.write_shard({k: records[k] for k in keys[start:start + SHARD_RECORDS]})
    size = [side * 8, side * 8]
    samples = [{"split": "train", "caption": "", "original_size": size, "crop_box": [0, 0, *size], "resized": size,
                "size": size, "repeats": 1, "latent": f"latent{i:04d}", "text": f"text{i:04d}"} for i in range(SAMPLES)]
    write_index(out, {"family": family, "dtype": dtype, "models": {}, "text_options": {}, "text": {},
                      "normalisation": {"kind": "scale_shift", "scale": 0.18215}, "empty_text": f"text{SAMPLES:04d}",
                      "flip": False}, samples,
                [{"id": f"s{i:04d}", "dataset": ""} for i in range(SAMPLES)], store.index())
    return out


def samples_per_second(encoded: Path, batch: int, workers: int, model: Path) -> float:
    from lorapipe.stages import families
    from lorapipe.stages.encoded import EncodedData
    from lorapipe.stages.train import TrainParams
    from lorapipe.stages.train.data import BatchPlan, MicroBatches, prepare_micro_batch

    data = EncodedData(encoded, encoded / "cache")
    plan, params = BatchPlan(data.split("train"), 0, batch, 1), TrainParams(batch_size=batch)
    family = families.get(data.family)  # the SD families need no binding to a model
    objective = family.objective(model, params)
    prepare = lambda m: prepare_micro_batch(data, plan, family, objective, params, m, 0)  # noqa: E731
    batches = MicroBatches(prepare, 0, BATCHES, workers, pin=False)
    started = time.perf_counter()
    for m in range(BATCHES):
        batches.get(m)
    seconds = time.perf_counter() - started
    batches.close()
    return BATCHES * batch / seconds


def verification(data: EncodedData, plan: BatchPlan) -> Callable[[int], None]:
    """What checking micro-batch m's records adds to reading them: one digest of each record's
    bytes (every latent and text of the batch, and the empty prompt, which load_batch reads once)."""
    from lorapipe.cache.digest import digest_bytes

    records = {r.key: r for s in data.samples for r in (s.latent, s.text)} | {data.empty.key: data.empty}
    payloads = {key: data.store.read(key, r.location, "safetensors") for key, r in records.items()}

    def check(m: int) -> None:
        for key in [data.empty.key, *(r.key for s in plan.batch(m, 0) for r in (s.latent, s.text))]:
            digest_bytes(payloads[key])

    return check


def verify_ms_per_batch(encoded: Path, batch: int) -> float:
    from lorapipe.stages.encoded import EncodedData
    from lorapipe.stages.train.data import BatchPlan

    data = EncodedData(encoded, encoded / "cache")
    check = verification(data, BatchPlan(data.split("train"), 0, batch, 1))
    started = time.perf_counter()
    for m in range(BATCHES):
        check(m)
    return (time.perf_counter() - started) / BATCHES * 1e3


def throughput(root: Path) -> list[dict]:
    model = tiny_model(root)  # its noise schedule: SD's
    rows = []
    for setting, (*_, batch) in SETTINGS.items():
        out = root / f"loader-{setting}"
        shutil.rmtree(out, ignore_errors=True)
        encoded = synthetic_encoded(out, setting)
        samples_per_second(encoded, batch, 2, model)  # warm the page cache and the allocator
        rates = {f"workers_{w}": round(samples_per_second(encoded, batch, w, model), 1) for w in (0, 1, 2)}
        verify_ms = min(verify_ms_per_batch(encoded, batch) for _ in range(3))
        rows.append({"setting": setting, "batch": batch, "samples_s": rates,
                     "two_threads_over_inline": round(rates["workers_2"] / rates["workers_0"], 2),
                     "verify_ms_per_batch": round(verify_ms, 3),
                     "verify_share_of_inline_preparation": round(verify_ms / 1e3 * rates["workers_0"] / batch, 4)})
    return rows
