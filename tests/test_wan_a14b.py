"""Wan 2.2 A14B end to end on the tiny model: the low-noise expert's LoRA trained through the train
stage on the demo clips Wan 2.1 encoded (A14B shares its text encoder and VAE), then evaluated with
that LoRA loaded into its expert."""
from __future__ import annotations

import json

import pytest
from PIL import Image, ImageChops
from safetensors import safe_open
from test_train import run_train, train_inputs

from lorapipe.cache.errors import UserError
from lorapipe.stages.evaluate import EvalInputs, EvalParams, run
from lorapipe.stages.evaluate.render import cell

LOW_NOISE = dict(denoiser="low_noise", target_modules="attention", max_steps=4, checkpoint_every=2)


@pytest.fixture(scope="module")
def a14b_model(tiny_models):
    return tiny_models("wan2.2-a14b")


def test_train_denoiser_is_refused_before_training(tmp_path, a14b_model, wan_model, wan_clips_encoded):
    with pytest.raises(UserError, match="train.denoiser: this Wan model has 2 denoisers, each trained by a LoRA of"
                                        " its own: set it to one of high_noise, low_noise"):
        run_train(tmp_path, "none", train_inputs(a14b_model, wan_clips_encoded), **{**LOW_NOISE, "denoiser": None})
    with pytest.raises(UserError, match="train.denoiser: Wan has one denoiser, there is none to choose; remove it"):
        run_train(tmp_path, "one", train_inputs(wan_model, wan_clips_encoded), **LOW_NOISE)


@pytest.mark.slow
def test_low_noise_expert_trains_and_evaluates_in_its_expert(tmp_path, a14b_model, wan_clips_encoded):
    """Training writes the expert's LoRA under transformer's names with the choice recorded (its log
    says diffusers will not read the attention-only musubi file); evaluate loads it into transformer_2
    (the render changes) and scores the held-out loss at the loss timesteps of the expert's range only."""
    out, built = run_train(tmp_path, "low", train_inputs(a14b_model, wan_clips_encoded), **LOW_NOISE)
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
