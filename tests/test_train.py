"""The train stage on the tiny SD1.5 and SDXL models and the encoded demo photos (6 train samples),
CPU only, every run a real training subprocess (the recipe directly for one process, `accelerate launch`
for DDP or a user's accelerate config); the trainings a test compares with another (resumes, shorter
trainings, loader threads, init_lora) run one after another in one process started ahead (`warm`).

One 120-step training (`trained`) is shared: its files, its loss curve, exact resume against it,
that its exported LoRA files reproduce the trained UNet, and a start from its LoRA (init_lora).
Also: SDXL export into StableDiffusionXLPipeline, a non-finite loss, repeats and mirrored latents,
that no worker outlives its parent (SIGINT, SIGKILL), and exact resume on clips (the tiny Wan 2.1).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import pytest
import torch
from parallel import trained_ahead
from safetensors import safe_open
from safetensors.torch import load_file

from lorapipe.cache.errors import UserError
from lorapipe.stages import train
from lorapipe.stages.processes.launching import WorkerFailed
from lorapipe.stages.processes.placement import Placement
from lorapipe.stages.lora_formats.diffusers_format import save_safetensors_sorted
from lorapipe.stages.train.checkpoints import CheckpointDir
from lorapipe.stages.train.data import BatchPlan, MicroBatches

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


def run_train(tmp: Path, name: str, inputs: train.TrainInputs, work: Path | None = None,
              options: dict | None = None, placement: Placement | None = None, **overrides):
    out = tmp / f"out-{name}"
    out.mkdir()
    built = train.run(train.TrainParams(**{**PARAMS, **overrides}), inputs, out, work or tmp / f"work-{name}",
                      train.TrainOptions(log_every=20, **(options or {})), log=lambda line: None, placement=placement)
    return out, built


def losses(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "logs" / "loss.jsonl").read_text().splitlines()]


def trajectory(out: Path) -> list[tuple[int, float, float]]:
    """(step, loss, lr) per row of loss.jsonl: what a resumed run must reproduce (not the wall times)."""
    return [(e["step"], e["loss"], e["lr"]) for e in losses(out)]


@pytest.fixture(scope="module")
def warm():
    """Where a compared training runs: one process started ahead (parallel.py), which trains as a
    process of its own would (test_a_process_started_ahead_...) without each training's imports."""
    with trained_ahead() as placement:
        yield placement


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
    assert (out / "logs" / "loss.png").read_bytes().startswith(b"\x89PNG")
    assert list((out / "logs" / "tracker").glob("events.out.tfevents.*"))  # TensorBoard, the default tracker


def train_log(out: Path) -> list[tuple[datetime, str]]:
    """train.log's lines: (the wall time it was written, the line)."""
    rows = [line.split(" ", 2) for line in (out / "logs" / "train.log").read_text().splitlines()]
    return [(datetime.strptime(f"{day} {clock}", "%Y-%m-%d %H:%M:%S.%f"), text) for day, clock, text in rows]


def test_progress_shows_from_the_first_step_as_a_bar_with_rate_and_eta(trained):
    progress = [text for _, text in train_log(trained[0]) if text.startswith("step ")]
    assert [int(text.split()[1].split("/")[0]) for text in progress] == [1, *range(20, STEPS + 1, 20)]
    assert all(re.search(r"\|[# 0-9]{20}\| +\d+% \[\d\d:\d\d<\d\d:\d\d, +[\d.]+it/s\]$", text)
               for text in progress), progress


def test_loss_rows_and_log_lines_carry_wall_time(trained):
    out, _ = trained
    rows, lines = losses(out), train_log(out)
    started = lines[0][0].timestamp()
    assert started <= rows[0]["time"] <= rows[-1]["time"] <= lines[-1][0].timestamp() + 1
    assert all(a["time"] <= b["time"] for a, b in zip(rows, rows[1:]))
    assert all(0 < row["seconds"] < 60 for row in rows)
    assert sum(row["seconds"] for row in rows) <= rows[-1]["time"] - started


def test_training_leaves_one_core_to_the_rest_unless_told(trained, tmp_path, tiny_model, encoded):
    threads = re.compile(r"rank 0/1: .*, (\d+) torch threads")
    first_line = next(threads.search(text) for _, text in train_log(trained[0]) if threads.search(text))
    assert int(first_line[1]) == max(1, len(os.sched_getaffinity(0)) - 1)
    out, _ = run_train(tmp_path, "threads", train_inputs(tiny_model, encoded), max_steps=1, options={"cpu_threads": 2})
    told = next(threads.search(text) for _, text in train_log(out) if threads.search(text))
    assert int(told[1]) == min(2, len(os.sched_getaffinity(0)))  # torch takes no more threads than cores


def test_loss_goes_down(trained):
    values = [e["loss"] for e in losses(trained[0])]
    first, last = sum(values[:30]) / 30, sum(values[-30:]) / 30
    assert last < 0.6 * first, (first, last)


def test_resume_is_exact(trained, tmp_path, tiny_model, encoded, warm):
    inputs, work = train_inputs(tiny_model, encoded), tmp_path / "work"
    run_train(tmp_path, "first-half", inputs, work, placement=warm, max_steps=STEPS // 2)
    out, built = run_train(tmp_path, "resumed", inputs, work, placement=warm)
    assert built.info["resumed_from"] == STEPS // 2
    assert trajectory(out) == trajectory(trained[0])  # bit-exact: the same floats, printed the same
    ours, straight = load_file(out / "pytorch_lora_weights.safetensors"), load_file(trained[0] / "pytorch_lora_weights.safetensors")
    assert ours.keys() == straight.keys()
    assert all(torch.equal(ours[k], straight[k]) for k in ours)
    for rel in ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_kohya.safetensors",
                "train_config.json", "checkpoints/step-000080/pytorch_lora_weights.safetensors"):
        assert (out / rel).read_bytes() == (trained[0] / rel).read_bytes(), rel


def test_resume_with_lora_dropout_is_exact(tmp_path, tiny_model, encoded, warm):
    inputs, dropout = train_inputs(tiny_model, encoded), dict(dropout=0.3, checkpoint_every=10, placement=warm)
    straight, _ = run_train(tmp_path, "straight", inputs, max_steps=20, **dropout)
    run_train(tmp_path, "half", inputs, tmp_path / "work", max_steps=10, **dropout)
    resumed, built = run_train(tmp_path, "resumed", inputs, tmp_path / "work", max_steps=20, **dropout)
    assert built.info["resumed_from"] == 10 and trajectory(resumed) == trajectory(straight)


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def same_tensors(a: Path, b: Path) -> bool:
    ours, theirs = load_file(a), load_file(b)
    return ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_a_shorter_training_starts_from_the_longer_ones_checkpoint_and_leaves_it_as_it_was(
        trained, tmp_path, tiny_model, encoded, warm):
    """Over the 120-step training's work folder (checkpoints 80 and 120, a constant lr): max_steps 80
    is its step-000080 exported as is, max_steps 100 trains on from it, both as a straight run
    would (the 120-step run's losses, and at 80 its LoRA); its files stay byte for byte."""
    work, inputs, logs = tmp_path / "work", train_inputs(tiny_model, encoded), []
    shutil.copytree(trained[0].parent / "work-straight", work)
    before = files_of(work)
    at_80 = train.run(train.TrainParams(**{**PARAMS, "max_steps": 80}), inputs, tmp_path / "out-80", work,
                      train.TrainOptions(), log=logs.append, placement=warm)
    out, at_100 = run_train(tmp_path, "100", inputs, work, placement=warm, max_steps=100)
    assert (at_80.info["resumed_from"], at_100.info["resumed_from"]) == (80, 80)
    assert any("its step-000080 is this training's result" in line for line in logs), logs
    assert same_tensors(tmp_path / "out-80" / "pytorch_lora_weights.safetensors",
                        trained[0] / "checkpoints" / "step-000080" / "pytorch_lora_weights.safetensors")
    assert trajectory(tmp_path / "out-80") == trajectory(trained[0])[:80]
    assert trajectory(out) == trajectory(trained[0])[:100]  # bit-exact: the same floats at every step
    assert files_of(work) == before  # the longer training's checkpoints, losses and exports; no folder left


def test_a_shorter_training_under_a_schedule_of_the_total_starts_from_scratch_beside_it(tmp_path, tiny_model, encoded,
                                                                                       warm):
    inputs, cosine, logs = train_inputs(tiny_model, encoded), dict(lr_scheduler="cosine", checkpoint_every=2), []
    run_train(tmp_path, "6", inputs, tmp_path / "work", placement=warm, max_steps=6, **cosine)
    before = files_of(tmp_path / "work")
    out = tmp_path / "out-4"
    built = train.run(train.TrainParams(**{**PARAMS, **cosine, "max_steps": 4}), inputs, out, tmp_path / "work",
                      train.TrainOptions(), log=logs.append, placement=warm)
    straight, _ = run_train(tmp_path, "straight", inputs, placement=warm, max_steps=4, **cosine)
    assert built.info["resumed_from"] is None and any("training from scratch" in line for line in logs), logs
    assert trajectory(out) == trajectory(straight)
    assert same_tensors(out / "pytorch_lora_weights.safetensors", straight / "pytorch_lora_weights.safetensors")
    assert files_of(tmp_path / "work") == before


@pytest.mark.slow
def test_resume_on_clips_is_exact(tmp_path, wan_model, wan_clips_encoded, warm):
    """The tiny Wan 2.1 on 9-frame clip windows: 10 steps, then max_steps raised to 20 over the same
    work folder, trains what 20 straight steps train, bit for bit (losses and LoRA files)."""
    inputs = train_inputs(wan_model, wan_clips_encoded)
    clips = dict(target_modules="attention", checkpoint_every=5, placement=warm)
    straight, _ = run_train(tmp_path, "straight", inputs, max_steps=20, **clips)
    run_train(tmp_path, "first-half", inputs, tmp_path / "work", max_steps=10, **clips)
    resumed, built = run_train(tmp_path, "resumed", inputs, tmp_path / "work", max_steps=20, **clips)
    assert built.info["resumed_from"] == 10
    assert [e["step"] for e in losses(resumed)] == list(range(1, 21))
    assert trajectory(resumed) == trajectory(straight)
    for name in ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_comfyui.safetensors",
                 "pytorch_lora_weights_kohya.safetensors"):
        assert (resumed / name).read_bytes() == (straight / name).read_bytes(), name


def test_loader_threads_train_what_the_step_would_prepare_itself(trained, tmp_path, tiny_model, encoded, warm):
    out, _ = run_train(tmp_path, "threads", train_inputs(tiny_model, encoded), options={"loader_workers": 2},
                       placement=warm, max_steps=40)
    assert trajectory(out) == trajectory(trained[0])[:40]  # trained prepared them in the step (the CPU default)


def test_micro_batches_come_in_order_and_raise_a_workers_error():
    def prepare(m: int) -> int:
        if m == 5:
            raise OSError("shard abc.tar is truncated")
        return m

    batches = MicroBatches(prepare, first=3, end=10, workers=2, pin=False)
    assert [batches.get(3), batches.get(4)] == [3, 4]
    with pytest.raises(OSError, match="shard abc.tar is truncated"):
        batches.get(5)
    batches.close()  # returns although the other worker waits with a full queue
    with pytest.raises(RuntimeError, match="micro-batch 7 asked for, 3 expected"):
        MicroBatches(prepare, first=3, end=10, workers=0, pin=False).get(7)


def test_exported_loras_reproduce_the_trained_unet(trained, tiny_model):
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel
    from peft import LoraConfig

    from lorapipe.stages.lora_formats.diffusers_format import load_diffusers_lora

    out = trained[0]
    reference = UNet2DConditionModel.from_pretrained(tiny_model, subfolder="unet")
    reference.add_adapter(LoraConfig(r=4, lora_alpha=8.0, target_modules=list(TARGETS)))
    load_diffusers_lora(reference, out / "checkpoints" / f"step-{STEPS:06d}" / "pytorch_lora_weights.safetensors", "unet")
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
    assert len([text for _, text in train_log(out) if text.startswith("step 4/4")]) == 1  # main process only


def test_child_failure_is_reported_in_one_line(tmp_path, tiny_model, encoded):
    broken = tmp_path / "no-unet-weights"  # passes the parent's checks, fails where the worker loads the UNet
    shutil.copytree(tiny_model, broken, ignore=shutil.ignore_patterns("diffusion_pytorch_model.safetensors"))
    inputs = train.TrainInputs(encoded.artifact_dir, encoded.cache_root, broken, "x", "y")
    with pytest.raises(WorkerFailed) as failure:
        run_train(tmp_path, "bad", inputs, max_steps=2)
    assert "no-unet-weights" in str(failure.value) and "\n" not in str(failure.value)
    assert "Traceback" in (tmp_path / "work-bad" / "logs" / "train.log").read_text()  # kept for the log


def test_a_latent_damaged_in_place_stops_training_with_one_line_naming_its_shard(tmp_path, tiny_model, encoded_copy,
                                                                                  damage_in_place):
    from lorapipe.cache.samples import DamagedRecord
    from lorapipe.stages.encoded import EncodedData

    data = EncodedData(encoded_copy.artifact_dir, encoded_copy.cache_root)
    latent = data.split("train")[0].latent
    shard = damage_in_place(data.store, latent)
    with pytest.raises(DamagedRecord) as refused:  # raised in the accelerate worker, again in the parent
        run_train(tmp_path, "damaged", train_inputs(tiny_model, encoded_copy), max_steps=4)
    assert refused.value.shard == latent.location.shard and refused.value.key == latent.key
    assert str(refused.value).startswith(f"{shard}: record {latent.key} does not match") and "\n" not in str(refused.value)
    assert f"error: {shard}: record {latent.key}" in (tmp_path / "work-damaged" / "logs" / "train.log").read_text()


def test_batch_plan_deals_equal_disjoint_batches(encoded):
    from lorapipe.stages.encoded import EncodedData

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
    with pytest.raises(UserError, match="every checkpoint"):
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
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:  # the CPU machines: a clear refusal
        with pytest.raises(ValueError, match="optimizer: adamw8bit needs bitsandbytes"):
            train.TrainParams(optimizer="adamw8bit")


def test_sdxl_lora_loads_into_the_sdxl_pipeline(tmp_path, sdxl_model, sdxl_encoded):
    from diffusers import StableDiffusionXLPipeline, UNet2DConditionModel
    from peft import LoraConfig

    from lorapipe.stages.lora_formats.diffusers_format import load_diffusers_lora

    inputs = train_inputs(sdxl_model, sdxl_encoded)
    out, built = run_train(tmp_path, "sdxl", inputs, max_steps=6, checkpoint_every=6)
    assert built.info["steps"] == 6 and json.loads((out / "train_config.json").read_text())["family"] == "sdxl"
    trained = UNet2DConditionModel.from_pretrained(sdxl_model, subfolder="unet")
    trained.add_adapter(LoraConfig(r=4, lora_alpha=8.0, target_modules=list(TARGETS)))
    load_diffusers_lora(trained, out / "checkpoints" / "step-000006" / "pytorch_lora_weights.safetensors", "unet")
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(2, 4, 8, 8, generator=g), torch.tensor([10, 700]), torch.randn(2, 77, 64, generator=g))
    added = {"text_embeds": torch.randn(2, 32, generator=g), "time_ids": torch.tensor([[64., 64, 0, 0, 64, 64]] * 2)}
    with torch.no_grad():
        expected = trained.eval()(*args, added_cond_kwargs=added).sample
        base = UNet2DConditionModel.from_pretrained(sdxl_model, subfolder="unet").eval()(*args, added_cond_kwargs=added).sample
        assert (expected - base).abs().max() > 1e-3
        for name in ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_kohya.safetensors"):
            pipe = StableDiffusionXLPipeline.from_pretrained(sdxl_model)
            pipe.load_lora_weights(out, weight_name=name)
            got = pipe.unet.eval()(*args, added_cond_kwargs=added).sample
            assert (got - expected).abs().max() < 1e-5, name


def test_flipped_latents_are_drawn_half_the_time(sdxl_encoded):
    from lorapipe.stages.encoded import EncodedData
    from lorapipe.stages.train.data import draws_flipped, load_batch

    data = EncodedData(sdxl_encoded.artifact_dir, sdxl_encoded.cache_root)
    sample = data.split("train")[0]
    assert not torch.equal(data.latent(sample)[0], data.latent(sample, flipped=True)[0])
    draws = [draws_flipped(sample, torch.Generator().manual_seed(seed)) for seed in range(200)]
    assert 70 < sum(draws) < 130
    flipped_seed = draws.index(True)
    batch = load_batch(data, [sample], torch.Generator().manual_seed(flipped_seed), 0.0)
    again = load_batch(data, [sample], torch.Generator().manual_seed(flipped_seed), 0.0)
    assert torch.equal(batch.latents, again.latents)  # seeded: resume stays exact
    mean, std = data.latent(sample, flipped=True)
    rng = torch.Generator().manual_seed(flipped_seed)
    torch.rand((), generator=rng)  # the coin comes before the posterior sample
    expected = (mean + std * torch.randn(mean.shape, generator=rng)) * data.normalisation.scale
    assert torch.equal(batch.latents[0], expected)


def test_batch_plan_repeats_samples(encoded):
    from lorapipe.stages.encoded import EncodedData

    samples = EncodedData(encoded.artifact_dir, encoded.cache_root).split("train")
    samples[0] = replace(samples[0], repeats=3)
    plan = BatchPlan(samples, seed=0, batch_size=1, num_processes=1)
    assert plan.batches_per_epoch == len(samples) + 2
    epoch = [plan.batch(m, 0)[0].id for m in range(plan.batches_per_epoch)]
    assert epoch.count(samples[0].id) == 3 and all(epoch.count(s.id) == 1 for s in samples[1:])


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, tiny_model, encoded):
    # lr 1e30: Adam moves every LoRA weight by about 1e30 in step 1, so step 2's forward overflows
    with pytest.raises(WorkerFailed) as failure:
        run_train(tmp_path, "nan", train_inputs(tiny_model, encoded), learning_rate=1e30, max_steps=5,
                  checkpoint_every=1, keep_checkpoints=5)
    work = tmp_path / "work-nan"
    first_line = str(failure.value).splitlines()[0]
    assert "FloatingPointError: loss is" in first_line and "at step 2" in first_line, first_line
    assert f"{work}/checkpoints/step-000001 is kept" in first_line, first_line
    checkpoints = CheckpointDir(work / "checkpoints")
    assert checkpoints.steps() == [1] and checkpoints.damage(1) == ""
    assert not (tmp_path / "out-nan" / "pytorch_lora_weights.safetensors").exists()


def test_init_lora_starts_from_that_lora(trained, tmp_path, tiny_model, encoded, warm):
    """Step 1's loss is computed before the first update: it must be the init LoRA's loss on the
    plan's first batch, computed here with the recipe's own data and loss functions."""
    from diffusers import UNet2DConditionModel
    from peft import LoraConfig

    from lorapipe.stages import families
    from lorapipe.stages.encoded import EncodedData
    from lorapipe.stages.lora_formats.diffusers_format import load_diffusers_lora
    from lorapipe.stages.train.data import derived_seed, load_batch, step_inputs
    from lorapipe.stages.train.recipe import step_loss

    init = trained[0] / "pytorch_lora_weights.safetensors"
    inputs = replace(train_inputs(tiny_model, encoded), init_lora_digest="init-digest")
    out, _ = run_train(tmp_path, "init", inputs, placement=warm, init_lora=str(init), max_steps=1)
    params = train.TrainParams(**PARAMS)
    data = EncodedData(encoded.artifact_dir, encoded.cache_root)
    unet = UNet2DConditionModel.from_pretrained(tiny_model, subfolder="unet")
    unet.add_adapter(LoraConfig(r=4, lora_alpha=8.0, target_modules=list(TARGETS)))
    load_diffusers_lora(unet, init, "unet")
    rng = torch.Generator().manual_seed(derived_seed(params.seed, "batch", 0, 0))
    batch = load_batch(data, BatchPlan(data.split("train"), params.seed, 2, 1).batch(0, 0), rng, 0.0)
    family = families.for_model(tiny_model)
    objective = family.objective(tiny_model, params)
    inputs = step_inputs(family, objective, batch, rng, params)
    with torch.no_grad():
        expected = step_loss(family, objective, unet.train(), inputs, torch.device("cpu"), torch.float32)
    first = losses(out)[0]["loss"]
    assert first == pytest.approx(expected.item(), rel=1e-5)
    assert first < 0.5 * losses(trained[0])[0]["loss"]  # not the zero-initialised start
    with safe_open(out / "pytorch_lora_weights.safetensors", "pt") as f:
        config = json.loads(f.metadata()["lorapipe.train_config"])
    assert config["init_lora_digest"] == "init-digest" and "init_lora" not in config["params"]  # not its path


def test_init_lora_must_match_rank_and_alpha(trained, tiny_model):
    from diffusers import UNet2DConditionModel

    from lorapipe.stages.train.adapter import load_init_lora, peft_config

    unet = UNet2DConditionModel.from_pretrained(tiny_model, subfolder="unet")
    params = train.TrainParams(rank=4, alpha=4.0)
    unet.add_adapter(peft_config(params, list(TARGETS)))
    with pytest.raises(ValueError, match="train.init_lora: .* has alpha 8.0 but train.alpha is 4.0"):
        load_init_lora(unet, trained[0] / "pytorch_lora_weights.safetensors", params, "unet")


# Ctrl-C in a terminal; Python leaves SIGINT ignored where its launcher ignored it (a background job)
PARENT = """
import signal, sys
from pathlib import Path
from lorapipe.cache.errors import UserError
from lorapipe.stages import train
from lorapipe.stages.processes.launching import WorkerFailed
signal.signal(signal.SIGINT, signal.default_int_handler)
inputs = train.TrainInputs(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), "base", "encoded")
train.run(train.TrainParams(max_steps=100000, batch_size=2, checkpoint_every=100000), inputs,
          Path(sys.argv[4]), Path(sys.argv[5]), train.TrainOptions(log_with="none", log_every=10**9))
"""


def recipe_processes(job: Path) -> list:
    import psutil

    found = []
    for process in psutil.process_iter(["cmdline"]):
        if str(job) in " ".join(process.info["cmdline"] or ()) and process.status() != psutil.STATUS_ZOMBIE:
            found.append(process)
    return found


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["sigint", "sigkill"])
def test_stopping_the_parent_leaves_no_worker(sig, tmp_path, tiny_model, encoded):
    """SIGINT: the parent terminates its children; SIGKILL: the kernel does (PR_SET_PDEATHSIG).
    The worker prints nothing once started, so no broken pipe kills it instead."""
    work, out = tmp_path / "work", tmp_path / "out"
    out.mkdir()
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(encoded.artifact_dir), str(encoded.cache_root),
                               str(tiny_model), str(out), str(work)], cwd=Path(__file__).parent.parent,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log, deadline = work / "logs" / "train.log", time.monotonic() + 240
    while not (log.exists() and "rank 0/1" in log.read_text()):  # the worker is past its start
        assert parent.poll() is None and time.monotonic() < deadline, "the training never started"
        time.sleep(0.5)
    assert recipe_processes(work / "job.json")
    parent.send_signal(sig)
    parent.wait(timeout=60)
    deadline = time.monotonic() + 30
    while recipe_processes(work / "job.json") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert recipe_processes(work / "job.json") == []


def test_init_lora_is_keyed_by_its_content_not_its_path(tmp_path, tiny_model, demo_images):
    from lorapipe.cache.store import Artifact
    from lorapipe.flows.config import validate_config
    from lorapipe.flows.steps import Context, train_step

    def key(lora: Path) -> str:
        raw = {"name": "t", "cache_dir": tmp_path / "cache", "output_dir": tmp_path / "out", "model": {"path": tiny_model},
               "data": {"path": demo_images}, "train": {"init_lora": str(lora)}, "evaluate": {"prompts": ["a cat"]}}
        ctx = Context(validate_config(raw, "test"), log=lambda m: None)
        try:
            return train_step(ctx, Artifact("encode", "k", tmp_path, {"digest": "encoded"})).key.key
        finally:
            ctx.close()

    first, moved = tmp_path / "a.safetensors", tmp_path / "elsewhere" / "b.safetensors"
    save_safetensors_sorted({"x": torch.zeros(2)}, {}, first)
    moved.parent.mkdir()
    save_safetensors_sorted({"x": torch.zeros(2)}, {}, moved)
    assert key(first) == key(moved)
    save_safetensors_sorted({"x": torch.ones(2)}, {}, moved)
    assert key(first) != key(moved)
    with pytest.raises(UserError, match="train.init_lora: .*missing.safetensors is not a file"):
        key(tmp_path / "missing.safetensors")


def test_sdxl_crop_conditioning_is_mirrored_with_a_flipped_latent():
    from lorapipe.cache.samples import RecordLocation
    from lorapipe.stages import families
    from lorapipe.stages.encoded import Record, Sample

    where = Record("key", RecordLocation("shard", {"safetensors": (0, 1, "digest")}))
    sample = Sample("a", "train", "cap", (480, 750), (10, 0, 74, 64), (64, 64), where, where, resized=(64, 100))
    text = {"hidden_states": torch.zeros(77, 64), "pooled": torch.zeros(32)}
    time_ids = families.get("sdxl").conditioning([text, text], [(sample, False), (sample, True)],
                                                   families.ObjectiveParams())["time_ids"]
    assert time_ids.tolist() == [[480, 750, 0, 10, 64, 64], [480, 750, 0, 26, 64, 64]]


def test_encoded_data_of_another_model_is_refused_in_one_line_naming_both(tmp_path, tiny_model, sdxl_model, encoded):
    """Before anything launches: SD1.x records for an SDXL model, or records another VAE made for a
    model of the same family (the flow passes the model's component digests)."""
    from lorapipe.cache.digest import StatCache
    from lorapipe.stages import families
    from lorapipe.stages.models import component_digests

    sdxl = train_inputs(sdxl_model, encoded)
    with pytest.raises(UserError) as refused:
        run_train(tmp_path, "sdxl", sdxl, max_steps=1)
    message = str(refused.value)
    assert "encoded by another model (sd15" in message and f"than {sdxl_model} (sdxl" in message
    assert "re-run encode" in message and "\n" not in message
    other_vae = tmp_path / "other-vae"
    shutil.copytree(tiny_model, other_vae)
    config = other_vae / "vae" / "config.json"
    config.write_text(config.read_text().replace('"sample_size": 64', '"sample_size": 32'))
    with StatCache(tmp_path / "stat.sqlite") as stats:
        digests = component_digests(other_vae, stats, families.get("sd15"))
    with pytest.raises(UserError, match=r"encoded by another model \(sd15: vae [0-9a-f]{12}\) than .*other-vae \(sd15: vae"):
        run_train(tmp_path, "vae", replace(train_inputs(other_vae, encoded), model_digests=digests), max_steps=1)


def test_a_users_accelerate_config_launches_training_and_a_missing_one_is_named(tmp_path, tiny_model, encoded,
                                                                                   monkeypatch):
    """`accelerate config`'s default file (under HF_HOME) is used when there is one; one named by
    train.accelerate_config must exist."""
    import yaml

    default = tmp_path / "hf" / "accelerate" / "default_config.yaml"
    default.parent.mkdir(parents=True)
    default.write_text(yaml.safe_dump({"compute_environment": "LOCAL_MACHINE", "distributed_type": "NO",
                                       "num_processes": 1, "num_machines": 1, "use_cpu": True}))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    said, out = [], tmp_path / "out"
    out.mkdir()
    built = train.run(train.TrainParams(**{**PARAMS, "max_steps": 1}), train_inputs(tiny_model, encoded), out,
                      tmp_path / "work", train.TrainOptions(log_with="none"), log=said.append)
    assert built.info["steps"] == 1
    assert f"with accelerate config {default}" in said[0]
    missing = tmp_path / "mine.yaml"
    with pytest.raises(UserError, match=rf"train.accelerate_config: {missing} is not a file"):
        train.run(train.TrainParams(**PARAMS), train_inputs(tiny_model, encoded), out, tmp_path / "work2",
                  train.TrainOptions(accelerate_config=str(missing)))


def test_a_process_started_ahead_encodes_then_trains_as_fresh_processes_would(trained, tmp_path, tiny_model,
                                                                                encoded, capsys):
    """`lorapipe run` starts one worker process while Prefect starts and the stages before train
    run; encode hands it its job, then train hands it the training job, instead of each working in
    a process of its own (torch and diffusers imported once): the same records, the same training
    (evaluate's job: tests/test_evaluate.py)."""
    from conftest import _encode_demo_images
    from lorapipe.stages import encode
    from lorapipe.stages.encoded import EncodedData
    from lorapipe.stages.processes.placement import OwnProcess, WarmProcess, place

    params, options = train.TrainParams(**{**PARAMS, "max_steps": 40}), train.TrainOptions(log_every=20)
    assert isinstance(place(train.where(params, options)), OwnProcess)  # what a run starts a warm process for
    with WarmProcess(OwnProcess().threads(options.cpu_threads), train.unused_libraries(params)) as warm:
        mine = _encode_demo_images(tmp_path / "cache", tiny_model, encode.EncodeParams(),
                                   placement=place(encode.where(encode.EncodeOptions()), warm))
        assert warm.alive()  # the process that encoded stays for the training job
        assert "encode: in the process started ahead\nencode: process 0 of 1: 8 latents" in capsys.readouterr().out
        theirs = EncodedData(encoded.artifact_dir, encoded.cache_root)
        ours = EncodedData(mine.artifact_dir, mine.cache_root)
        assert [s.id for s in ours.samples] == [s.id for s in theirs.samples]
        assert all(ours.latent(a)[0].equal(theirs.latent(b)[0]) for a, b in zip(ours.samples, theirs.samples))
        said, out = [], tmp_path / "out"
        out.mkdir()
        train.run(params, train_inputs(tiny_model, mine), out, tmp_path / "work", options, log=said.append,
                  placement=place(train.where(params, options), warm))
        assert "train: in the process started ahead" in said and warm.alive()  # it stays for evaluate's job
    assert trajectory(out) == trajectory(trained[0])[:40]


def test_a_training_process_loads_only_the_quantisation_library_its_job_uses(tmp_path):
    """diffusers imports bitsandbytes and torchao whenever they are installed (about a quarter of a
    training process's imports, BENCHMARKS.md); a training process hides the ones its job does not
    use before diffusers is imported, and loads the one it does (nf4: bitsandbytes)."""
    from lorapipe.stages.processes.jobs import Job
    from lorapipe.stages.processes.launching import start_worker
    from lorapipe.stages.train.params import TrainSpec

    # what the worker entry (stages/processes/jobs.py) does before the job runs, then what training imports
    probe = ("import sys; from lorapipe.stages.processes.jobs import Job, worker; from lorapipe.stages.processes.optional_libraries"
             " import hide; job = Job.read(sys.argv[1]); hide(job.hidden); worker(job.stage);"
             " import diffusers.training_utils, peft;"
             " print(sorted(name for name in ('bitsandbytes', 'torchao') if sys.modules.get(name)))")
    for setting, loaded in (("none", "[]"), ("nf4", "['bitsandbytes']")):
        params = train.TrainParams(**{**PARAMS, "base_quantization": setting})
        spec = TrainSpec(params=params, inputs=train.TrainInputs(tmp_path, tmp_path, tmp_path, "x", "y"),
                         options=train.TrainOptions())
        job = Job("train", spec, tmp_path / setting, 1, train.unused_libraries(params)).write()
        output, _ = start_worker([sys.executable, "-c", probe, str(job)]).communicate()
        assert output.strip().splitlines()[-1] == loaded, output
