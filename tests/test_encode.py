"""Encode: bad pixels are reported, long captions warned about, buckets and flips, colour modes,
CUDA out-of-memory halving, SDXL, two processes, damaged shards, and an interrupted encode
resumes after its last committed shard."""
from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lorapipe.cache.digest import StatCache
from lorapipe.cache.samples import SampleStore
from lorapipe.stages import encode, families, preprocess
from lorapipe.stages.processes.cpu_threads import threads_per_process
from lorapipe.stages.encoded import EncodedData
from lorapipe.stages.models import component_digests
from lorapipe.stages.preprocess.rows import read_rows

REPO = Path(__file__).resolve().parent.parent


def prepare(tmp_path: Path, demo_images: Path) -> Path:
    data = tmp_path / "data"
    shutil.copytree(demo_images, data)
    return data


def encode_inputs(tmp_path: Path, data: Path, model: Path, **params) -> encode.EncodeInputs:
    pre = tmp_path / "pre"
    pre.mkdir(exist_ok=True)
    sources = (preprocess.DatasetSource(path=data),)
    with StatCache(tmp_path / "stat.sqlite") as cache:
        preprocess.run(preprocess.PreprocessParams(**{"resolution": 64, "holdout_fraction": 0.25, **params}),
                       preprocess.PreprocessInputs(sources, cache), pre, tmp_path, None, lambda m: None)
        family = families.for_model(model)
        digests = component_digests(model, cache, family)
    return encode.EncodeInputs(pre, sources, tmp_path / "cache", model, family.name, digests)


def run_encode(tmp_path: Path, inputs: encode.EncodeInputs, params=encode.EncodeParams(), **options):
    out = tmp_path / "enc"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    logs: list[str] = []
    built = encode.run(params, inputs, out, tmp_path, encode.EncodeOptions(**{"num_workers": 0, **options}),
                       logs.append)
    return out, built, logs


def test_an_image_changed_or_broken_since_preprocess_is_reported_and_the_rest_encoded(tmp_path, demo_images,
                                                                                      tiny_model):
    data = prepare(tmp_path, demo_images)
    inputs = encode_inputs(tmp_path, data, tiny_model)
    jpeg = (data / "coffee.jpg").read_bytes()
    (data / "coffee.jpg").write_bytes(jpeg[: len(jpeg) // 3])  # a readable header, truncated pixels
    out, built, logs = run_encode(tmp_path, inputs)
    assert built.info["undecodable"] == 1 and built.info["latents_encoded"] == 7
    assert "changed since preprocess" in json.loads((out / "logs" / "report.json").read_text())["undecodable"]["coffee.jpg"]
    assert any("coffee.jpg" in line for line in logs)
    assert "coffee" not in {s.id for s in EncodedData(out, tmp_path / "cache").samples}


def test_a_caption_longer_than_the_window_is_truncated_with_a_warning(tmp_path, demo_images, tiny_model):
    data = prepare(tmp_path, demo_images)
    (data / "rocket.txt").write_text("a very long caption " * 40)
    _, built, logs = run_encode(tmp_path, encode_inputs(tmp_path, data, tiny_model))
    assert any("warning" in line and "rocket.jpg" in line for line in logs)
    assert built.info["texts_encoded"] == 9


KILLABLE = textwrap.dedent("""
    import pickle, sys, time
    from lorapipe.stages import encode
    inputs, out = pickle.load(open(sys.argv[1], "rb"))
    slow = lambda message: time.sleep(0.5) if message.startswith("encode: latents") else None  # time to be killed
    encode.run(encode.EncodeParams(), inputs, out, out, encode.EncodeOptions(num_workers=0, batch_size=2,
               shard_records=2, progress_every=0), slow)
""")


@pytest.mark.slow
def test_a_killed_encode_resumes_after_its_last_committed_shard(tmp_path, demo_images, tiny_model,
                                                               count_encoder_rows):
    inputs = encode_inputs(tmp_path, prepare(tmp_path, demo_images), tiny_model)
    import pickle

    (tmp_path / "job.pkl").write_bytes(pickle.dumps((inputs, tmp_path / "killed")))
    (tmp_path / "killed").mkdir()
    victim = subprocess.Popen([sys.executable, "-c", KILLABLE, str(tmp_path / "job.pkl")], cwd=REPO)
    samples = tmp_path / "cache" / "samples"
    deadline = time.time() + 120
    while len(list(samples.glob("*.json"))) < 6:  # 5 text shards, then the first latent shard
        assert victim.poll() is None and time.time() < deadline, "encode finished or hung before the kill"
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    dataset = read_rows(inputs.preprocess_dir / "dataset.json")
    keys = [encode.latent_key(s, encode.EncodeParams(), inputs.model_digests["vae"]) for s in dataset]
    committed = 8 - len(SampleStore(inputs.cache_root).missing(keys))
    assert 0 < committed < 8
    with count_encoder_rows() as counts:
        _, built, _ = run_encode(tmp_path, inputs)
    assert counts == {"vae": 8 - committed, "text": 0}
    assert built.info["latents_reused"] == committed


def test_cuda_out_of_memory_halves_the_batch_and_says_so():
    import torch

    from lorapipe.stages.encode.latents import halve_on_oom

    def fits_two(batch: torch.Tensor) -> torch.Tensor:
        if len(batch) > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return batch * 2

    logs: list[str] = []
    chunks = halve_on_oom(fits_two, torch.arange(7.0), logs.append)
    assert [len(c) for c in chunks] == [2, 2, 2, 1] and torch.equal(torch.cat(chunks), torch.arange(7.0) * 2)
    assert logs[0] == "encode: CUDA out of memory on a batch of 7; retrying as 4 + 3" and len(logs) == 3
    with pytest.raises(torch.cuda.OutOfMemoryError):
        halve_on_oom(lambda b: fits_two(b.repeat(3)), torch.ones(1), logs.append)


def test_colour_modes_become_rgb_and_alpha_lands_on_the_background():
    from PIL import Image

    from lorapipe.stages.encode.images import to_rgb

    clear = Image.new("RGBA", (2, 2), (255, 0, 0, 0))
    assert to_rgb(clear, (0, 0, 255)).getpixel((0, 0)) == (0, 0, 255)
    assert to_rgb(Image.new("LA", (2, 2), (100, 255)), (0, 0, 0)).getpixel((0, 0)) == (100, 100, 100)
    palette = Image.new("P", (2, 2), 0)
    palette.info["transparency"] = 0
    assert to_rgb(palette, (0, 255, 0)).getpixel((0, 0)) == (0, 255, 0)
    assert to_rgb(Image.new("CMYK", (2, 2), (0, 255, 255, 0)), None).getpixel((0, 0)) == (255, 0, 0)
    assert to_rgb(Image.new("I;16", (2, 2), 40000), None).getpixel((0, 0)) == (156, 156, 156)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_shown_upright(tmp_path, orientation):
    import numpy as np
    from PIL import Image, ImageOps

    from lorapipe.stages.encode.images import resized_upright

    stored = Image.fromarray(np.random.default_rng(0).integers(0, 255, (90, 150, 3), dtype=np.uint8))
    exif = Image.Exif()
    exif[0x0112] = orientation
    stored.save(tmp_path / "turned.png", exif=exif.tobytes())
    with Image.open(tmp_path / "turned.png") as im:
        expected = ImageOps.exif_transpose(im).convert("RGB").resize((45, 30) if orientation < 5 else (30, 45),
                                                                       Image.BICUBIC)
    with Image.open(tmp_path / "turned.png") as im:
        ours = resized_upright(im, (expected.height, expected.width), None)
    assert ours.size == expected.size
    assert np.abs(np.asarray(ours, dtype=int) - np.asarray(expected, dtype=int)).max() <= 1  # rounding order


def test_a_large_jpeg_is_decoded_at_a_reduced_scale_with_the_same_pixels(tmp_path):
    import numpy as np
    from PIL import Image

    from lorapipe.stages.encode.images import resized_upright

    grain = np.random.default_rng(0).normal(0, 6, (1500, 2000, 3))
    photo = np.asarray(Image.linear_gradient("L").resize((2000, 1500)).convert("RGB"), dtype=float) + grain
    Image.fromarray(photo.clip(0, 255).astype(np.uint8)).save(tmp_path / "photo.jpg", quality=90)
    with Image.open(tmp_path / "photo.jpg") as im:
        full = im.convert("RGB").resize((256, 192), Image.BICUBIC)
    with Image.open(tmp_path / "photo.jpg") as im:
        ours = resized_upright(im, (192, 256), None)
        assert im.size == (1000, 750)  # decoded at 1/2 scale: 1/4 would be less than twice the target
    mse = ((np.asarray(ours, dtype=float) - np.asarray(full, dtype=float)) ** 2).mean()
    assert 10 * np.log10(255**2 / mse) > 45


def bucket_images(folder: Path) -> Path:
    from PIL import Image

    folder.mkdir()
    for i, (size, mode) in enumerate([((128, 64), "RGB"), ((130, 60), "L"), ((64, 128), "RGBA"), ((64, 64), "P"),
                                      ((140, 70), "CMYK"), ((70, 70), "RGB")]):
        pixels = Image.linear_gradient("L").rotate(90).resize(size).convert(mode)  # left to right
        pixels.save(folder / f"img{i}.{'jpg' if mode == 'CMYK' else 'png'}")
        (folder / f"img{i}.txt").write_text(f"picture {i}")
    return folder


def test_buckets_and_flips_are_encoded_by_size_as_their_own_records(tmp_path, tiny_model, count_encoder_rows):
    data = bucket_images(tmp_path / "data")
    inputs = encode_inputs(tmp_path, data, tiny_model, buckets=True, bucket_sizes=[[128, 64], [64, 128], [64, 64]],
                           holdout_fraction=0)
    with count_encoder_rows() as counts:
        out, built, logs = run_encode(tmp_path, inputs, encode.EncodeParams(flip=True), batch_size=4)
    assert counts["vae"] == 12 and built.info["latents_encoded"] == 12
    assert built.info["sizes"] == {"128x64": 3, "64x128": 1, "64x64": 2}
    assert any("img/s]" in line and "reused" in line for line in logs)
    data_ = EncodedData(out, inputs.cache_root)
    for sample in data_.samples:
        (mean, _), (flipped, _) = data_.latent(sample), data_.latent(sample, flipped=True)
        assert tuple(mean.shape[1:]) == (sample.size[0] // 8, sample.size[1] // 8) == tuple(flipped.shape[1:])
        assert not torch_equal(mean, flipped) and sample.repeats == 1
    with count_encoder_rows() as counts:
        _, again, _ = run_encode(tmp_path, inputs, encode.EncodeParams(flip=True))
    assert counts["vae"] == 0 and again.info["latents_reused"] == 12


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


def test_sdxl_records_hold_both_encoders_and_the_pooled_embedding(tmp_path, demo_images, sdxl_model):
    inputs = encode_inputs(tmp_path, prepare(tmp_path, demo_images), sdxl_model)
    out, built, _ = run_encode(tmp_path, inputs, batch_size=8)
    data = EncodedData(out, inputs.cache_root)
    text = data.text(data.samples[0])
    assert data.family == "sdxl" and built.info["texts_encoded"] == 9 and text["pooled"].ndim == 1
    assert text["hidden_states"].shape[-1] == 64  # two 32-wide tiny encoders, concatenated


def test_a_damaged_shard_is_found_by_cache_verify_removed_and_re_encoded(tmp_path, demo_images, tiny_model,
                                                                         count_encoder_rows, capsys):
    from lorapipe.cache.store import ArtifactStore, StageKey
    from lorapipe.flows.cli import main

    inputs = encode_inputs(tmp_path, prepare(tmp_path, demo_images), tiny_model)
    store = ArtifactStore(inputs.cache_root)
    key = StageKey("encode", {"test": 1})
    build = lambda out, work: encode.run(encode.EncodeParams(), inputs, out, work,  # noqa: E731
                                         encode.EncodeOptions(num_workers=0, shard_records=3), lambda m: None)
    artifact, _ = store.build(key, build, {})
    shard = EncodedData(artifact.path, inputs.cache_root).samples[0].latent.location.shard
    tar = SampleStore(inputs.cache_root).shard_path(shard)
    damaged = bytearray(tar.read_bytes())
    damaged[600] ^= 0xFF  # same size: only re-hashing finds it
    tar.write_bytes(bytes(damaged))
    records = len(SampleStore(inputs.cache_root).shard_meta(shard)["records"])
    assert main(["cache", "verify", "--cache-dir", str(inputs.cache_root)]) == 1
    printed = capsys.readouterr().out
    assert "encode" in printed and f"{shard[:12]}  DAMAGED: does not match its recorded digest; removed" in printed
    assert not tar.exists() and not store.lookup("encode", key.key).hit
    with count_encoder_rows() as counts:
        _, computed = store.build(key, build, {})
    assert computed and counts["vae"] == records
    assert main(["cache", "verify", "--cache-dir", str(inputs.cache_root)]) == 0


@pytest.mark.slow
def test_encode_worker_processes_load_diffusers_without_the_quantisation_libraries(tmp_path, demo_images, tiny_model,
                                                                                monkeypatch):
    """Encode's worker processes (num_processes > 1) never use bitsandbytes or torchao, which diffusers
    imports where they are installed: they hide them (stages/processes/optional_libraries.py). Python's import
    profile, which every process inherits through PYTHONPROFILEIMPORTTIME, lists what each one loaded."""
    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")
    inputs = encode_inputs(tmp_path, prepare(tmp_path, demo_images), tiny_model)
    _, built, _ = run_encode(tmp_path, inputs, num_processes=2, batch_size=2, shard_records=2)
    assert built.info["processes"] == 2 and built.info["latents_encoded"] == 8
    profile = (tmp_path / "logs" / "encode.log").read_text()
    loaded = set(re.findall(r"\|\s+(diffusers|bitsandbytes|torchao)\.", profile))
    assert loaded == {"diffusers"}  # a name hidden is only tried (its line has no submodules)


@pytest.mark.slow
def test_two_processes_encode_each_record_once_into_one_index(tmp_path, demo_images, tiny_model, encoded):
    inputs = encode_inputs(tmp_path, prepare(tmp_path, demo_images), tiny_model)
    out, built, logs = run_encode(tmp_path, inputs, num_processes=2, batch_size=2, shard_records=2)
    assert built.info["processes"] == 2 and built.info["latents_encoded"] == 8 and built.info["texts_encoded"] == 9
    threads = threads_per_process(None, processes=2)  # the cores less one, shared (stages/processes/cpu_threads.py)
    assert f"[rank 1] encode: process 1 of 2: 4 latents, 4 text embeddings, {threads} torch threads" in logs
    assert any(line.startswith("encode: latents 4/4 (rank 0's share of 2)") for line in logs)
    store = SampleStore(inputs.cache_root)
    written = [k for meta in store.dir.glob("*.json") for k in json.loads(meta.read_text())["records"]]
    assert len(written) == len(set(written)) == 17  # 8 latents + 8 captions + the empty prompt, once each
    mine, reference = EncodedData(out, inputs.cache_root), EncodedData(encoded.artifact_dir, encoded.cache_root)
    import torch

    for a, b in zip(mine.samples, reference.samples):
        assert a.id == b.id and torch.allclose(mine.latent(a)[0], reference.latent(b)[0], atol=1e-5)


def test_the_lines_of_two_workers_sharing_a_pipe_never_merge():
    """The processes of one launch write into one pipe with PYTHONUNBUFFERED=1 (lines reach the
    parent at once); a worker writes each printed line in one system call, so two ranks' lines
    arrive whole (a merged line once failed the two-process encode test above)."""
    from lorapipe.stages.processes.launching import start_worker

    rank_prints = ("import sys; from lorapipe.stages.processes.launching import write_whole_lines; write_whole_lines();"
                   " [print(f'[rank {sys.argv[1]}] line', i, flush=True) for i in range(3000)]")
    launcher = ("import subprocess, sys; ranks = [subprocess.Popen([sys.executable, '-c', sys.argv[1], str(r)])"
                " for r in (0, 1)]; [p.wait() for p in ranks]")
    output, _ = start_worker([sys.executable, "-c", launcher, rank_prints]).communicate()
    lines = output.splitlines()
    assert len(lines) == 6000 and all(re.fullmatch(r"\[rank [01]\] line \d+", line) for line in lines), \
        [line for line in lines if not re.fullmatch(r"\[rank [01]\] line \d+", line)][:5]
