"""Encode: bad pixels are reported, long captions warned about, and an interrupted encode
resumes after its last committed shard."""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cache.digest import StatCache
from cache.samples import SampleStore
from stages import encode, preprocess
from stages.encoded import EncodedData
from stages.models import component_digests

REPO = Path(__file__).resolve().parent.parent


def prepare(tmp_path: Path, demo_images: Path) -> Path:
    data = tmp_path / "data"
    shutil.copytree(demo_images, data)
    return data


def encode_inputs(tmp_path: Path, data: Path, model: Path) -> encode.EncodeInputs:
    pre = tmp_path / "pre"
    pre.mkdir(exist_ok=True)
    with StatCache(tmp_path / "stat.sqlite") as cache:
        preprocess.run(preprocess.PreprocessParams(resolution=64, holdout_fraction=0.25),
                       preprocess.PreprocessInputs(data, cache), pre, tmp_path, None, lambda m: None)
        digests = component_digests(model, cache)
    return encode.EncodeInputs(pre, data, tmp_path / "cache", model, "sd15", digests)


def run_encode(tmp_path: Path, inputs: encode.EncodeInputs, **options):
    out = tmp_path / "enc"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    logs: list[str] = []
    built = encode.run(encode.EncodeParams(), inputs, out, tmp_path, encode.EncodeOptions(num_workers=0, **options),
                       logs.append)
    return out, built, logs


def test_an_undecodable_image_is_reported_and_the_rest_encoded(tmp_path, demo_images, tiny_model):
    data = prepare(tmp_path, demo_images)
    jpeg = (data / "coffee.jpg").read_bytes()
    (data / "coffee.jpg").write_bytes(jpeg[: len(jpeg) // 3])  # a readable header, truncated pixels
    out, built, logs = run_encode(tmp_path, encode_inputs(tmp_path, data, tiny_model))
    assert built.info["undecodable"] == 1 and built.info["latents_encoded"] == 7
    assert "coffee.jpg" in json.loads((out / "report.json").read_text())["undecodable"]
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
    from stages import encode
    inputs, out = pickle.load(open(sys.argv[1], "rb"))
    slow = lambda message: time.sleep(0.5) if "images" in message else None  # time to be killed
    encode.run(encode.EncodeParams(), inputs, out, out, encode.EncodeOptions(num_workers=0, batch_size=2,
               shard_records=2), slow)
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
    dataset = json.loads((inputs.preprocess_dir / "dataset.json").read_text())["samples"]
    keys = [encode.latent_key(s, encode.EncodeParams(), inputs.model_digests["vae"]) for s in dataset]
    committed = 8 - len(SampleStore(inputs.cache_root).missing(keys))
    assert 0 < committed < 8
    with count_encoder_rows() as counts:
        _, built, _ = run_encode(tmp_path, inputs)
    assert counts == {"vae": 8 - committed, "text": 0}
    assert built.info["latents_reused"] == committed
