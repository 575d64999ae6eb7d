"""Encode: pipeline throughput vs the bare VAE + text-encoder forward on the same batches,
and reuse when 1% of the images are new."""
from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from .common import device_sync, generated_images, tiny_model

if TYPE_CHECKING:
    import torch

BATCH = 16


def encode_inputs(data: Path, cache: Path, model: Path, resolution: int = 64, role: str = "train", **settings):
    """Preprocess `data` (a dataset of this `role`) at `resolution` (and the other preprocess
    `settings`) into `cache`/pre (every image in the train split); the encode stage's inputs for it."""
    from lorapipe.cache.digest import StatCache
    from lorapipe.stages import encode, families, preprocess
    from lorapipe.stages.models import component_digests

    pre, sources = cache / "pre", (preprocess.DatasetSource(path=data, role=role),)
    shutil.rmtree(pre, ignore_errors=True)
    pre.mkdir(parents=True)
    with StatCache(cache / "stat.sqlite") as stats:
        preprocess.run(preprocess.PreprocessParams(resolution=resolution, holdout_fraction=0.0, **settings),
                       preprocess.PreprocessInputs(sources, stats), pre, cache, None, lambda m: None)
        family = families.for_model(model)
        digests = component_digests(model, stats, family)
    return encode.EncodeInputs(pre, sources, cache, model, family.name, digests)


def run_encode(inputs, out: Path, workers: int = 1, batch_size: int = BATCH, dtype: str = "float32", **options):
    from lorapipe.stages import encode

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    return encode.run(encode.EncodeParams(dtype=dtype), inputs, out, out,
                      encode.EncodeOptions(batch_size=batch_size, num_workers=workers, **options), lambda m: None)


class Encoders(NamedTuple):
    vae: object  # the family's LatentEncoder
    text: object  # the family's TextEncoder
    device: torch.device


def load_encoders(inputs, device: str = "cpu", dtype: torch.dtype | None = None) -> Encoders:
    """The family's latent and text encoders as the encode stage loads them: float32 weights on
    `device`, text records cast to the record dtype `dtype` (default float32)."""
    import torch

    from lorapipe.stages.families import TextOptions

    family = inputs.bound_family()
    settings = family.text_settings(inputs.model_path, TextOptions())
    text = family.text_encoder(inputs.model_path, settings, dtype or torch.float32, device)
    return Encoders(family.load_latent_encoder(inputs.model_path, device), text, torch.device(device))


def bare_forward_seconds(inputs, n: int, encoders: Encoders, batch_size: int = BATCH) -> float:
    """The latent encoder + text encoder on pre-decoded batches: the floor the pipeline can approach."""
    import torch

    from lorapipe.stages.encode import ImageCrops
    from lorapipe.stages.preprocess.rows import read_rows

    samples = read_rows(inputs.preprocess_dir / "dataset.json")[:n]
    crops = ImageCrops(inputs.datasets, samples, [False] * n)
    starts = range(0, n, batch_size)
    batches = [torch.stack([crops[i][1] for i in range(s, min(s + batch_size, n))]) for s in starts]
    captions = [[s.caption for s in samples[i:i + batch_size]] for i in starts]
    sync = device_sync(encoders.device)
    sync()
    started = time.perf_counter()
    with torch.inference_mode():
        for pixels, caps in zip(batches, captions):
            encoders.vae(pixels)  # the posterior's mean and std, on the CPU as the stage keeps them
            encoders.text(caps)
    sync()
    return time.perf_counter() - started


def throughput(root: Path, n: int = 512, rounds: int = 3) -> dict:
    """The fastest of `rounds` alternating runs of each (single runs swung from 0.61 to 0.97)."""
    model = tiny_model(root)
    data = generated_images(root / f"images-{n}", n)
    bare = pipeline = float("inf")
    for r in range(rounds):
        cache = root / "enc-throughput"
        shutil.rmtree(cache, ignore_errors=True)  # every record encoded again
        inputs = encode_inputs(data, cache, model)
        bare = min(bare, bare_forward_seconds(inputs, n, load_encoders(inputs)))
        started = time.perf_counter()
        run_encode(inputs, cache / "out")
        pipeline = min(pipeline, time.perf_counter() - started)
    return {"images": n, "rounds": rounds, "pipeline_img_s": round(n / pipeline, 1), "bare_img_s": round(n / bare, 1),
            "ratio": round(bare / pipeline, 3)}


def incremental(root: Path, n: int = 10000) -> dict:
    model = tiny_model(root)
    shutil.rmtree(root / f"images-grow-{n}", ignore_errors=True)  # it grows by 1% each run
    data = generated_images(root / f"images-grow-{n}", n)
    cache = root / "enc-grow"
    shutil.rmtree(cache, ignore_errors=True)
    first = run_encode(encode_inputs(data, cache, model), cache / "out")
    generated_images(data, n + n // 100, seed=0)  # 1% more images
    second = run_encode(encode_inputs(data, cache, model), cache / "out")
    return {"images_before": n, "images_added": n // 100, "first_latents_encoded": first.info["latents_encoded"],
            "second_latents_encoded": second.info["latents_encoded"],
            "second_latents_reused": second.info["latents_reused"]}


def dask_workers(root: Path, n: int = 2048, rounds: int = 3) -> dict:
    """encode.executor: dask with 1 vs 2 local worker processes (one thread each), and the local
    executor, on the same images: the fastest of `rounds` alternating runs, each into an empty
    sample store. The clusters are started and warmed (imports, encoders loaded) before timing."""
    from distributed import LocalCluster

    model = tiny_model(root)
    data = generated_images(root / f"images-{n}", n)
    clusters = {w: LocalCluster(n_workers=w, threads_per_worker=1, processes=True, dashboard_address=":0")
                for w in (1, 2)}
    runs = {"local": {}, **{f"dask_{w}": {"executor": "dask", "dask_address": c.scheduler_address}
                            for w, c in clusters.items()}}
    best = dict.fromkeys(runs, float("inf"))
    try:
        for r in range(rounds + 1):  # round 0 warms the workers up
            for name, options in runs.items():
                cache = root / "enc-dask"
                shutil.rmtree(cache, ignore_errors=True)
                inputs = encode_inputs(data, cache, model)
                started = time.perf_counter()
                run_encode(inputs, cache / "out", **options)
                if r:
                    best[name] = min(best[name], time.perf_counter() - started)
    finally:
        for cluster in clusters.values():
            cluster.close()
    return {"images": n, "rounds": rounds, **{f"{name}_img_s": round(n / t, 1) for name, t in best.items()},
            "speedup_2_vs_1_workers": round(best["dask_1"] / best["dask_2"], 3)}
