"""The train stage on the tiny SD1.5 model and the encoded demo photos (6 train samples), CPU only.

One 120-step training (`trained`) is shared: its files, its loss curve, exact resume against it,
and that its exported LoRA files reproduce the trained UNet.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from stages import train
from stages.train.checkpoints import CheckpointDir
from stages.train.lora_files import save_safetensors_sorted
from stages.train.recipe import BatchPlan

os.environ["HF_HUB_OFFLINE"] = "1"

STEPS = 120
# LoRA on the attention projections alone barely moves this random tiny UNet's loss (1.05 -> 1.0 in
# 200 steps); with conv_in/conv_out too it drops from about 0.8 to 0.2 in 120 steps.
TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "conv_in", "conv_out")
PARAMS = dict(rank=4, alpha=8.0, target_modules=TARGETS, learning_rate=1e-2, batch_size=2, max_steps=STEPS,
              checkpoint_every=40, keep_checkpoints=2, seed=3)


def train_inputs(tiny_model: Path, encoded) -> train.TrainInputs:
    return train.TrainInputs(encoded_dir=encoded.artifact_dir, cache_root=encoded.cache_root,
                             model_path=tiny_model, base_model_digest="base-digest", encoded_digest=encoded.digest)


def run_train(tmp: Path, name: str, inputs: train.TrainInputs, work: Path | None = None, **overrides):
    out = tmp / f"out-{name}"
    out.mkdir()
    built = train.run(train.TrainParams(**{**PARAMS, **overrides}), inputs, out, work or tmp / f"work-{name}",
                      train.TrainOptions(log_every=20), log=lambda line: None)
    return out, built


def losses(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "logs" / "loss.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model, encoded):
    tmp = tmp_path_factory.mktemp("train")
    out, built = run_train(tmp, "straight", train_inputs(tiny_model, encoded))
    return out, built


def test_run_writes_lora_files_and_rotates_checkpoints(trained):
    out, built = trained
    assert built.info["steps"] == STEPS and built.info["resumed_from"] is None
    lora = load_file(out / "pytorch_lora_weights.safetensors")
    assert lora and all(k.startswith("unet.") and (".lora_A." in k or ".lora_B." in k) for k in lora), sorted(lora)[:3]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000080", "step-000120"]
    kohya = load_file(out / "pytorch_lora_weights_kohya.safetensors")
    assert all(k.startswith("lora_unet_") for k in kohya)
    assert {v.item() for k, v in kohya.items() if k.endswith(".alpha")} == {8.0}
    with safe_open(out / "pytorch_lora_weights.safetensors", "pt") as f:
        meta = f.metadata()
    assert meta["lorapipe.base_model_digest"] == "base-digest" and meta["lorapipe.steps"] == str(STEPS)
    assert json.loads(meta["lorapipe.train_config"])["params"]["rank"] == 4
    assert (out / "pytorch_lora_weights.safetensors").stat().st_mode & 0o777 == 0o644
    assert [e["step"] for e in losses(out)] == list(range(1, STEPS + 1))


def test_loss_goes_down(trained):
    values = [e["loss"] for e in losses(trained[0])]
    first, last = sum(values[:30]) / 30, sum(values[-30:]) / 30
    assert last < 0.6 * first, (first, last)


def test_resume_is_exact(trained, tmp_path, tiny_model, encoded):
    inputs, work = train_inputs(tiny_model, encoded), tmp_path / "work"
    run_train(tmp_path, "first-half", inputs, work, max_steps=STEPS // 2)
    out, built = run_train(tmp_path, "resumed", inputs, work)
    assert built.info["resumed_from"] == STEPS // 2
    assert losses(out) == losses(trained[0])  # bit-exact: the same floats, printed the same
    ours, straight = load_file(out / "pytorch_lora_weights.safetensors"), load_file(trained[0] / "pytorch_lora_weights.safetensors")
    assert ours.keys() == straight.keys()
    assert all(torch.equal(ours[k], straight[k]) for k in ours)
    for rel in ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_kohya.safetensors",
                "train_config.json", "checkpoints/step-000080/pytorch_lora_weights.safetensors"):
        assert (out / rel).read_bytes() == (trained[0] / rel).read_bytes(), rel


def test_exported_loras_reproduce_the_trained_unet(trained, tiny_model):
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel
    from peft import LoraConfig

    from stages.train.lora_files import load_diffusers_lora

    out = trained[0]
    reference = UNet2DConditionModel.from_pretrained(tiny_model, subfolder="unet")
    reference.add_adapter(LoraConfig(r=4, lora_alpha=8.0, target_modules=list(TARGETS)))
    load_diffusers_lora(reference, out / "checkpoints" / f"step-{STEPS:06d}" / "pytorch_lora_weights.safetensors")
    g = torch.Generator().manual_seed(0)
    sample, hidden = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 77, 32, generator=g)
    timesteps = torch.tensor([10, 700])
    with torch.no_grad():
        expected = reference.eval()(sample, timesteps, hidden).sample
        base = UNet2DConditionModel.from_pretrained(tiny_model, subfolder="unet").eval()(sample, timesteps, hidden).sample
        assert (expected - base).abs().max() > 1e-3  # the LoRA changed something
        for name in ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_kohya.safetensors"):
            pipe = StableDiffusionPipeline.from_pretrained(tiny_model, safety_checker=None)
            pipe.load_lora_weights(out, weight_name=name)
            got = pipe.unet.eval()(sample, timesteps, hidden).sample
            assert (got - expected).abs().max() < 1e-5, name


@pytest.mark.slow
def test_ddp_two_cpu_processes(tmp_path, tiny_model, encoded):
    out, built = run_train(tmp_path, "ddp", train_inputs(tiny_model, encoded), num_processes=2, max_steps=4,
                           checkpoint_every=2)
    log = (out / "logs" / "train.log").read_text()
    assert "rank 0/2" in log and "rank 1/2" in log
    assert built.info["steps"] == 4 and (out / "pytorch_lora_weights.safetensors").is_file()


def test_child_failure_is_reported(tmp_path, encoded):
    inputs = train.TrainInputs(encoded.artifact_dir, encoded.cache_root, tmp_path / "no-such-model", "x", "y")
    with pytest.raises(RuntimeError, match="exit code") as failure:
        run_train(tmp_path, "bad", inputs, max_steps=2)
    assert "no-such-model" in str(failure.value)


def test_batch_plan_deals_equal_disjoint_batches(encoded):
    from stages.encoded import EncodedData

    samples = EncodedData(encoded.artifact_dir, encoded.cache_root).split("train")
    plan = BatchPlan(samples, seed=0, batch_size=2, num_processes=2)  # 6 samples: one batch of 4, 2 dropped
    assert plan.batches_per_epoch == 1
    for m in range(4):
        ranks = [plan.batch(m, r) for r in range(2)]
        assert all(len(b) == 2 for b in ranks) and not {s.id for s in ranks[0]} & {s.id for s in ranks[1]}
    again = BatchPlan(samples, seed=0, batch_size=2, num_processes=2)
    assert [s.id for s in again.batch(3, 1)] == [s.id for s in plan.batch(3, 1)]
    with pytest.raises(ValueError, match="Lower batch_size"):
        BatchPlan(samples, seed=0, batch_size=4, num_processes=2)


def test_damaged_checkpoint_falls_back_then_refuses(tmp_path):
    checkpoints, warnings = CheckpointDir(tmp_path), []
    for step in (10, 20):
        checkpoints.staging(step).mkdir(parents=True)
        (checkpoints.staging(step) / "state.bin").write_bytes(b"x" * step)
        checkpoints.commit(step, max_steps=20)
    (checkpoints.path(20) / "state.bin").write_bytes(b"truncated")
    assert checkpoints.latest_intact(warnings.append) == 10 and "step-000020" in warnings[0]
    (checkpoints.path(10) / "checkpoint.json").unlink()
    with pytest.raises(RuntimeError, match="every checkpoint"):
        checkpoints.latest_intact(warnings.append)


def test_rotation_keeps_what_a_straight_run_keeps(tmp_path):
    checkpoints = CheckpointDir(tmp_path)
    for step in (100, 150, 200, 250):  # 150: where an earlier run stopped
        checkpoints.staging(step).mkdir(parents=True)
        checkpoints.commit(step, max_steps=step)
        checkpoints.rotate(step, every=100, keep=2)
    assert checkpoints.steps() == [200, 250]


def test_lora_files_are_byte_deterministic(tmp_path):
    tensors = {"b": torch.ones(3), "a": torch.zeros(2, 2)}
    metadata = {k: k * 2 for k in "qwertyuiop"}  # safetensors alone writes these in random order
    save_safetensors_sorted(tensors, metadata, tmp_path / "one.safetensors")
    save_safetensors_sorted(dict(reversed(tensors.items())), dict(reversed(metadata.items())), tmp_path / "two.safetensors")
    assert (tmp_path / "one.safetensors").read_bytes() == (tmp_path / "two.safetensors").read_bytes()
    with safe_open(tmp_path / "one.safetensors", "pt") as f:
        assert f.metadata() == metadata and torch.equal(f.get_tensor("b"), torch.ones(3))


def test_params_validation():
    with pytest.raises(ValueError):
        train.TrainParams(rank=0)
    with pytest.raises(ValueError, match="constant_with_warmup"):
        train.TrainParams(warmup_steps=10)
    assert train.TrainParams(target_modules=["to_q"]).target_modules == ("to_q",)
