"""A quantised frozen base (train.base_quantization) through the real stages on the tiny SD1.x and
Flux.1 models: int8 (and on SD1.x fp8 and nf4) trains, its loss curve stays close to the
unquantised one on the same seed without being equal to it, the setting reruns train and not
encode, and the LoRA it exports has the unquantised run's tensor names and shapes and loads through
the pipeline's load_lora_weights."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from family_checks import assert_means_what_was_trained, fused_change
from safetensors.torch import load_file
from test_invalidation import make_config, run_all, statuses
from test_train_flux1 import double_block_targets

from lorapipe.flows.config import ConfigError, validate_config
from lorapipe.flows.steps import STAGES
from lorapipe.stages import families

pytestmark = pytest.mark.slow

STEPS = 6
# Each step's loss may differ from the unquantised run's by this fraction. Both runs see identical
# batches, noise and timesteps, so the difference is the rounding of the base's weights: int8 rounds
# each to one of 255 levels per output channel (at most 0.4% of the channel's largest weight, random
# in sign), fp8 keeps 3 mantissa bits, nf4 16 levels per block of 64 weights. Measured over 6 steps,
# the largest difference per step: int8 0.025% (SD1.x and Flux.1), fp8 0.09%, nf4 0.6% (SD1.x). The
# bounds leave 8-20x that margin and are still far below what a base quantised wrongly (or an adapter
# quantised too) does to the loss.
RELATIVE_TOLERANCE = {"int8": 0.005, "fp8": 0.02, "nf4": 0.05}


def losses(result) -> list[float]:
    log = Path(result.path) / "logs" / "loss.jsonl"
    return [json.loads(line)["loss"] for line in log.read_text().splitlines() if line]


def run_quantised(tmp_path: Path, model: Path, demo_images: Path, count_encoder_rows, train: dict,
                  settings: tuple[str, ...]) -> tuple[dict, dict]:
    """Unquantised, then each setting over the same cache: the results by setting, and the encoder
    rows the quantised runs pushed."""
    shutil.copytree(demo_images, tmp_path / "data")
    configs = {q: make_config(tmp_path / q, model, tmp_path / "data", tmp_path / "cache",
                              train={**train, "max_steps": STEPS, "checkpoint_every": STEPS, "base_quantization": q})
               for q in ("none", *settings)}
    results = {"none": run_all(configs["none"], STAGES[:3])}
    with count_encoder_rows() as counts:
        results.update({q: run_all(configs[q], STAGES[:3]) for q in settings})
    return results, counts


def assert_close_not_equal(plain: list[float], quantised: list[float], setting: str) -> None:
    assert len(plain) == len(quantised) == STEPS
    assert plain != quantised  # the base really was quantised
    for a, b in zip(plain, quantised):
        assert abs(a - b) <= RELATIVE_TOLERANCE[setting] * a, (setting, plain, quantised)


def assert_same_lora_format(plain_dir: Path, int8_dir: Path, name: str) -> None:
    plain, int8 = load_file(plain_dir / name), load_file(int8_dir / name)
    assert {k: v.shape for k, v in plain.items()} == {k: v.shape for k, v in int8.items()}, name
    assert all(v.dtype == torch.float32 for v in int8.values())  # the adapter stayed in full precision


def test_quantised_bases_train_sd_close_to_the_unquantised_run_and_rerun_only_train(
        tmp_path, tiny_model, demo_images, count_encoder_rows):
    from diffusers import StableDiffusionPipeline

    settings = ("int8", "fp8", "nf4")
    results, counts = run_quantised(tmp_path, tiny_model, demo_images, count_encoder_rows, {"learning_rate": 1e-2},
                                    settings)
    assert counts == {"vae": 0, "text": 0}
    plain = results["none"]["train"]
    for setting in settings:
        assert statuses(results[setting]) == {"preprocess": "hit", "encode": "hit", "train": "computed"}
        assert_close_not_equal(losses(plain), losses(results[setting]["train"]), setting)
        for name in ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_kohya.safetensors"):
            assert_same_lora_format(Path(plain.path), Path(results[setting]["train"].path), name)
    out = Path(results["int8"]["train"].path)
    _assert_loads_as_trained(StableDiffusionPipeline.from_pretrained(tiny_model), tiny_model, out, "attention")


def test_int8_base_trains_flux1_close_to_the_unquantised_run(tmp_path, flux_model, demo_images, count_encoder_rows):
    from diffusers import FluxPipeline

    targets = tuple(double_block_targets(flux_model))
    results, counts = run_quantised(tmp_path, flux_model, demo_images, count_encoder_rows,
                                    {"learning_rate": 1e-2, "batch_size": 2, "target_modules": targets}, ("int8",))
    int8 = results["int8"]["train"]
    assert counts == {"vae": 0, "text": 0} and int8.status == "computed"
    assert_close_not_equal(losses(results["none"]["train"]), losses(int8), "int8")
    _assert_loads_as_trained(FluxPipeline.from_pretrained(flux_model), flux_model, Path(int8.path), targets)


def test_an_int8_base_trains_under_ddp(tmp_path, tiny_model, demo_images):
    """DDP's start-up broadcast cannot copy a quantised tensor: only the adapter is synchronised."""
    shutil.copytree(demo_images, tmp_path / "data")
    config = make_config(tmp_path, tiny_model, tmp_path / "data", tmp_path / "cache", train={
        "max_steps": 2, "checkpoint_every": 2, "num_processes": 2, "batch_size": 2, "base_quantization": "int8"})
    train = run_all(config, STAGES[:3])["train"]
    assert train.status == "computed" and len(losses(train)) == 2


def _assert_loads_as_trained(pipe, model: Path, out: Path, targets) -> None:
    """The diffusers file, through load_lora_weights and fuse_lora, changes each adapted weight of
    the full-precision base by the trained B @ A x scale."""
    from peft import LoraConfig

    from lorapipe.stages.lora_formats.diffusers_format import load_diffusers_lora

    family = families.for_model(model)
    trained = family.load_denoiser(model, torch.float32)
    names = family.lora_target_modules(trained, targets)
    config = json.loads((out / "train_config.json").read_text())["params"]
    trained.add_adapter(LoraConfig(r=config["rank"], lora_alpha=config["alpha"], target_modules=names))
    load_diffusers_lora(trained, out / "pytorch_lora_weights.safetensors", family.components.denoiser)
    adapted = [name for name, module in trained.named_modules() if hasattr(module, "lora_A")]
    change = fused_change(pipe, family.components.denoiser, out / "pytorch_lora_weights.safetensors")
    assert all(change[name].abs().max() > 0 for name in adapted)
    assert_means_what_was_trained(trained, adapted, change)


def quantised_config(tmp_path: Path, model: Path, setting: str) -> dict:
    return {"name": "t", "cache_dir": tmp_path, "output_dir": tmp_path, "model": {"path": model},
            "data": {"path": tmp_path}, "train": {"base_quantization": setting, "log_with": "none"},
            "evaluate": {"prompts": ["a cat"]}}


def test_a_quantisation_whose_library_is_missing_is_refused_in_one_line(tmp_path, tiny_model, monkeypatch):
    validate_config(quantised_config(tmp_path, tiny_model, "none"), "config.yaml")  # what validating imports
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # not imported, and not on the path:
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if not (Path(entry) / "bitsandbytes").exists()])
    with pytest.raises(ConfigError) as err:
        validate_config(quantised_config(tmp_path, tiny_model, "nf4"), "config.yaml")
    message = str(err.value)
    assert "\n" not in message and "train.base_quantization: nf4 needs bitsandbytes" in message


def test_a_quantisation_is_accepted_where_the_process_hides_its_installed_library(tmp_path, tiny_model, monkeypatch):
    """`lorapipe run` hides bitsandbytes and torchao from its own process (stages/processes/optional_libraries.py),
    where find_spec then says None; its training processes load the one the config names."""
    for library in ("bitsandbytes", "torchao"):
        monkeypatch.setitem(sys.modules, library, None)
    for setting in ("nf4", "int8"):
        config = validate_config(quantised_config(tmp_path, tiny_model, setting), "config.yaml")
        assert config.train.base_quantization == setting
