"""Encode: pipeline throughput vs the bare VAE + text-encoder forward on the same batches,
reuse when 1% of the images are new, and peak memory at two dataset sizes."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .common import generated_images, tiny_model

BATCH = 16


def _inputs(root: Path, data: Path, cache: Path, model: Path):
    from cache.digest import StatCache
    from stages import encode, preprocess
    from stages.models import component_digests

    pre, sources = cache / "pre", (preprocess.DatasetSource(path=data),)
    shutil.rmtree(pre, ignore_errors=True)
    pre.mkdir(parents=True)
    with StatCache(cache / "stat.sqlite") as stats:
        preprocess.run(preprocess.PreprocessParams(resolution=64, holdout_fraction=0.0),
                       preprocess.PreprocessInputs(sources, stats), pre, cache, None, lambda m: None)
        digests = component_digests(model, stats)
    return encode.EncodeInputs(pre, sources, cache, model, "sd15", digests)


def run_encode(inputs, out: Path, workers: int = 1):
    from stages import encode

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    return encode.run(encode.EncodeParams(), inputs, out, out, encode.EncodeOptions(batch_size=BATCH,
                      num_workers=workers), lambda m: None)


def bare_forward_seconds(inputs, n: int) -> float:
    """VAE encode + text encoder on pre-decoded batches: the floor the pipeline can approach."""
    import torch
    from diffusers import AutoencoderKL

    from stages.encode import ImageCrops, TextEncoder

    samples = json.loads((inputs.preprocess_dir / "dataset.json").read_text())["samples"][:n]
    crops = ImageCrops(inputs.datasets, samples, [False] * n)
    batches = [torch.stack([crops[i][1] for i in range(s, min(s + BATCH, n))]) for s in range(0, n, BATCH)]
    captions = [[s["caption"] for s in samples[i:i + BATCH]] for i in range(0, n, BATCH)]
    vae = AutoencoderKL.from_pretrained(inputs.model_path, subfolder="vae").eval()
    text = TextEncoder(inputs.model_path, "sd15", torch.float32)
    started = time.perf_counter()
    with torch.inference_mode():
        for pixels, caps in zip(batches, captions):
            vae.encode(pixels).latent_dist.mean.sum()
            text(caps)
    return time.perf_counter() - started


def throughput(root: Path, n: int = 512) -> dict:
    model = tiny_model(root)
    data = generated_images(root / f"images-{n}", n)
    cache = root / "enc-throughput"
    shutil.rmtree(cache, ignore_errors=True)
    inputs = _inputs(root, data, cache, model)
    bare = bare_forward_seconds(inputs, n)
    started = time.perf_counter()
    run_encode(inputs, cache / "out")
    pipeline = time.perf_counter() - started
    return {"images": n, "pipeline_img_s": round(n / pipeline, 1), "bare_img_s": round(n / bare, 1),
            "ratio": round(bare / pipeline, 3)}


def incremental(root: Path, n: int = 2000) -> dict:
    model = tiny_model(root)
    shutil.rmtree(root / f"images-grow-{n}", ignore_errors=True)  # it grows by 1% each run
    data = generated_images(root / f"images-grow-{n}", n)
    cache = root / "enc-grow"
    shutil.rmtree(cache, ignore_errors=True)
    first = run_encode(_inputs(root, data, cache, model), cache / "out")
    generated_images(data, n + n // 100, seed=0)  # 1% more images
    second = run_encode(_inputs(root, data, cache, model), cache / "out")
    return {"images_before": n, "images_added": n // 100, "first_latents_encoded": first.info["latents_encoded"],
            "second_latents_encoded": second.info["latents_encoded"],
            "second_latents_reused": second.info["latents_reused"]}


PEAK = """
import resource, sys
from pathlib import Path
from benchmarks.encode_bench import _inputs, run_encode
root, data, model = map(Path, sys.argv[1:4])
run_encode(_inputs(root, data, root / "cache", model), root / "cache" / "out")
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss + resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def peak_memory(root: Path, sizes=(200, 2000)) -> list[dict]:
    model = tiny_model(root)
    rows = []
    for n in sizes:
        data = generated_images(root / f"images-{n}", n)
        work = root / f"peak-{n}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        out = subprocess.run([sys.executable, "-c", PEAK, str(work), str(data), str(model)], check=True,
                             capture_output=True, text=True).stdout.split()[-1]
        rows.append({"images": n, "peak_rss_mib": round(int(out) / 1024, 1)})
    return rows
