"""Wan 2.2 A14B end to end on the tiny model: the low-noise expert's LoRA trained through the train
stage on the demo clips Wan 2.1 encoded (A14B shares its text encoder and VAE), then evaluated with
that LoRA loaded into its expert; both experts' LoRAs trained in one run, resumed exactly, and
loaded into the pipeline's two transformers."""
from __future__ import annotations

import json

import pytest
import torch
from family_checks import fused_change, quiet_pipeline
from parallel import trained_ahead
from PIL import Image, ImageChops
from safetensors import safe_open
from safetensors.torch import load_file
from test_train import losses, run_train, train_inputs, trajectory

from lorapipe.cache.errors import UserError
from lorapipe.stages.evaluate import EvalInputs, EvalParams, run
from lorapipe.stages.evaluate.render import cell

LOW_NOISE = dict(denoiser="low_noise", target_modules="attention", max_steps=4, checkpoint_every=2)
BOTH = dict(denoiser="both", target_modules="attention_ff", max_steps=8, checkpoint_every=4, rank=4, alpha=8.0)
EXPERTS = {"high_noise": ("transformer", {}), "low_noise": ("transformer_2", {"load_into_transformer_2": True})}


@pytest.fixture(scope="module")
def a14b_model(tiny_models):
    return tiny_models("wan2.2-a14b")


@pytest.fixture(scope="module")
def warm():
    """Where the module's trainings run: one process started ahead (parallel.py), which trains as a
    process of its own would, importing torch, diffusers and peft once for all of them."""
    with trained_ahead() as placement:
        yield placement


def test_train_denoiser_is_refused_before_training(tmp_path, a14b_model, wan_model, wan_clips_encoded):
    with pytest.raises(UserError, match="train.denoiser: this Wan model has 2 denoisers, each trained by a LoRA of"
                                        " its own: set it to one of high_noise, low_noise or both"):
        run_train(tmp_path, "none", train_inputs(a14b_model, wan_clips_encoded), **{**LOW_NOISE, "denoiser": None})
    with pytest.raises(UserError, match="train.denoiser: Wan has one denoiser, there is none to choose; remove it"):
        run_train(tmp_path, "one", train_inputs(wan_model, wan_clips_encoded), **LOW_NOISE)


@pytest.mark.slow
def test_low_noise_expert_trains_and_evaluates_in_its_expert(tmp_path, a14b_model, wan_clips_encoded, warm):
    """Training writes the expert's LoRA under transformer's names with the choice recorded (its log
    says diffusers will not read the attention-only musubi file); evaluate loads it into transformer_2
    (the render changes) and scores the held-out loss at the loss timesteps of the expert's range only."""
    out, built = run_train(tmp_path, "low", train_inputs(a14b_model, wan_clips_encoded), placement=warm, **LOW_NOISE)
    assert built.info["steps"] == 4
    with safe_open(out / "pytorch_lora_weights.safetensors", "pt") as f:
        assert all(k.startswith("transformer.blocks.") for k in f.keys())
        assert json.loads(f.metadata()["lorapipe.train_config"])["params"]["denoiser"] == "low_noise"
    assert "train: note: pytorch_lora_weights_kohya.safetensors loads in ComfyUI and musubi-tuner, not in diffusers" \
        in (out / "logs" / "train.log").read_text()  # an attention-only LoRA (test_families_wan.py)
    evaluated = tmp_path / "evaluate"
    evaluated.mkdir()
    params = EvalParams(prompts=("a red ball",), seeds=(0,), lora_scales=(1.0,), num_inference_steps=12,
                        resolution=32, num_frames=5, loss_timesteps=(100, 500, 900), loss_samples=2)
    inputs = EvalInputs(a14b_model, out, wan_clips_encoded.artifact_dir, wan_clips_encoded.cache_root,
                        base_model_digest="base", encoded_digest=wan_clips_encoded.digest, lora_digest="lora")
    run(params, inputs, evaluated, tmp_path / "evaluate-work", log=lambda message: None)
    metrics = json.loads((evaluated / "metrics.json").read_text())
    holdout = metrics["loss"]["holdout"]
    assert set(holdout["base"]["by_timestep"]) == set(holdout["lora"]["by_timestep"]) == {"100", "500"}
    assert holdout["base"]["overall"] != holdout["lora"]["overall"]
    grid = Image.open(evaluated / "grid.png")
    assert ImageChops.difference(cell(grid, 0, 0, 32), cell(grid, 0, 1, 32)).getbbox() is not None


@pytest.mark.slow
def test_both_experts_train_in_one_run_resume_exactly_and_load_into_their_transformers(
        tmp_path, a14b_model, wan_clips_encoded, warm):
    """train.denoiser both: each step trains the expert whose noise levels it draws (both get steps);
    4 steps, then 8 over the same work folder, train what 8 straight steps train, bit for bit; each
    expert's files, named by it, load into its transformer (the low-noise one's with
    load_into_transformer_2) and change it by the trained B @ A x alpha/rank,
    the other transformer not at all. Evaluate loads both (its render differs from the base model's on
    the same seed) and scores each expert's held-out loss at the loss timesteps of its own range, merged
    into one figure, as it scores each checkpoint's pair."""
    inputs = train_inputs(a14b_model, wan_clips_encoded)
    straight, _ = run_train(tmp_path, "straight", inputs, placement=warm, **BOTH)
    run_train(tmp_path, "half", inputs, tmp_path / "work", placement=warm, **{**BOTH, "max_steps": 4})
    resumed, built = run_train(tmp_path, "resumed", inputs, tmp_path / "work", placement=warm, **BOTH)
    assert built.info["resumed_from"] == 4 and trajectory(resumed) == trajectory(straight)
    assert {row["denoiser"] for row in losses(straight)} == set(EXPERTS)
    for expert, (component, load_kwargs) in EXPERTS.items():
        files = [f"pytorch_lora_weights{kind}_{expert}.safetensors" for kind in ("", "_kohya", "_comfyui")]
        for name in (*files, f"checkpoints/step-000004/{files[0]}"):
            assert (resumed / name).read_bytes() == (straight / name).read_bytes(), name
        trained = trained_change(straight / files[0], scale=BOTH["alpha"] / BOTH["rank"])
        for name in files:
            pipe = quiet_pipeline(a14b_model)
            other = next(c for c, _ in EXPERTS.values() if c != component)
            before = {n: p.clone() for n, p in getattr(pipe, other).named_parameters()}
            change = fused_change(pipe, component, straight / name, **load_kwargs)
            assert change.keys() >= trained.keys() and all(
                torch.allclose(delta, trained.get(module, torch.zeros_like(delta)), atol=1e-6)
                for module, delta in change.items()), name
            assert all(torch.equal(p, before[n]) for n, p in getattr(pipe, other).named_parameters()), name
    evaluated = tmp_path / "evaluate"
    evaluated.mkdir()
    params = EvalParams(prompts=("a red ball",), seeds=(0,), lora_scales=(1.0,), num_inference_steps=2,
                        resolution=32, num_frames=5, loss_timesteps=(100, 500, 900), loss_samples=2)
    run(params, EvalInputs(a14b_model, straight, wan_clips_encoded.artifact_dir, wan_clips_encoded.cache_root, "base",
                           wan_clips_encoded.digest, "lora"),
        evaluated, tmp_path / "evaluate-work", log=lambda message: None)
    metrics = json.loads((evaluated / "metrics.json").read_text())
    assert len([c for c in metrics["clips"] if c.endswith(".mp4")]) == 2  # the base and LoRA columns' clip
    assert all((evaluated / clip).is_file() for clip in metrics["clips"])
    grid = Image.open(evaluated / "grid.png")
    assert ImageChops.difference(cell(grid, 0, 0, 32), cell(grid, 0, 1, 32)).getbbox() is not None
    lora = metrics["loss"]["holdout"]["lora"]
    by_expert = {expert: set(result["by_timestep"]) for expert, result in lora["by_denoiser"].items()}
    assert by_expert == {"high_noise": {"900"}, "low_noise": {"100", "500"}}
    assert lora["by_timestep"] == {step: result["by_timestep"][step] for result in lora["by_denoiser"].values()
                                   for step in result["by_timestep"]}
    assert lora["overall"] == pytest.approx(sum(lora["by_timestep"].values()) / 3)
    base = metrics["loss"]["holdout"]["base"]
    assert all(lora["by_denoiser"][e]["overall"] != base["by_denoiser"][e]["overall"] for e in EXPERTS)  # each loaded
    steps = json.loads((evaluated / "checkpoint_losses.json").read_text())["checkpoints"]
    assert [row["step"] for row in steps] == [4, 8] and all(set(row["by_denoiser"]) == set(EXPERTS) for row in steps)
    assert steps[-1]["overall"] == lora["overall"] != steps[0]["overall"]


def trained_change(diffusers_file, scale: float) -> dict[str, torch.Tensor]:
    """Each module's weight change a diffusers-format LoRA file holds: B @ A x scale (its keys name
    `transformer`'s modules, whichever expert it trained)."""
    lora = load_file(diffusers_file)
    modules = {k.removeprefix("transformer.").removesuffix(".lora_A.weight") for k in lora if "lora_A" in k}
    return {m: lora[f"transformer.{m}.lora_B.weight"] @ lora[f"transformer.{m}.lora_A.weight"] * scale
            for m in modules}
