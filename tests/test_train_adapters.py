"""train.adapter and the EMA through the real train stage (a training subprocess per run) on the tiny
SD1.x and Flux.1 models: each adapter type trains with an EMA, a run resumed from the halfway
checkpoint (what a killed run leaves) publishes the same files byte for byte as one that ran straight, and the published files mean the trained
adapter (the ComfyUI and kohya files read by ComfyUI's key tables, the diffusers file through diffusers'
loader where it reads the type, and for SD its kohya file). init_lora is refused in one line for what cannot load."""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest
import torch
from comfyui_keys import assert_comfyui_applies_the_merged_model
from family_checks import merged, weight
from parallel import case_by_test, selected, started_warm
from safetensors import safe_open
from safetensors.torch import load_file

from lorapipe.stages import families, train
from lorapipe.stages.lora_formats.diffusers_format import add_adapter_from_file
from lorapipe.stages.lora_formats.lycoris import adapted_modules
from lorapipe.stages.processes.placement import Placement

STEPS = 4
PARAMS = dict(rank=2, alpha=3.0, target_modules="attention", learning_rate=1e-2, batch_size=2, max_steps=STEPS,
              checkpoint_every=2, keep_checkpoints=2, seed=1, ema_decay=0.5)
ADAPTERS = {"lora": {}, "dora": {"adapter": "dora"}, "lokr": {"adapter": "lokr"}, "loha": {"adapter": "loha"},
            "pissa": {"init": "pissa"}, "olora": {"init": "olora", "rslora": True}}
FILES = ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_comfyui.safetensors")
FAMILIES = {"sd": ("tiny_model", "encoded"), "flux": ("flux_model", "flux_encoded")}  # the model and encoded set fixtures
CASE_TESTS = {  # the tests of adapter_runs: a test's parameters -> its (family, kind)
    "test_sd_adapter_trains_with_ema_resumes_exactly_and_exports": lambda params: ("sd", params["kind"]),
    "test_flux_adapter_trains_with_ema_resumes_exactly_and_exports": lambda params: ("flux", params["kind"]),
    "test_init_lora_starts_a_lokr_from_a_lokr_file": lambda params: ("sd", "lokr")}


def run_train(tmp: Path, name: str, model: Path, encoded, work: Path, placement: Placement | None = None,
              **overrides) -> Path:
    """Train into tmp/out-{name} with PARAMS and `overrides`, where `placement` says (default: a process of its own)."""
    out = tmp / f"out-{name}"
    out.mkdir()
    inputs = train.TrainInputs(encoded_dir=encoded.artifact_dir, cache_root=encoded.cache_root, model_path=model,
                               base_model_digest="base", encoded_digest=encoded.digest)
    train.run(train.TrainParams(**{**PARAMS, **overrides}), inputs, out, work,
              train.TrainOptions(log_with="none", cpu_threads=1), log=lambda line: None, placement=placement)
    return out


@dataclass(frozen=True)
class AdapterRun:
    tmp: Path  # holds out-straight, out-resumed, work-straight and the resumed run's work
    straight: Path
    resumed: Path


def train_straight_and_resumed(tmp: Path, model: Path, encoded, settings: dict,
                               placement: Placement | None = None) -> AdapterRun:
    """A run straight through, and one resumed from what a run killed after its first checkpoint
    leaves: that checkpoint (committed atomically), copied from the straight run's work dir."""
    straight = run_train(tmp, "straight", model, encoded, tmp / "work-straight", placement, **settings)
    halfway = f"checkpoints/step-{settings.get('max_steps', STEPS) // 2:06d}"
    shutil.copytree(tmp / "work-straight" / halfway, tmp / "work" / halfway)
    return AdapterRun(tmp, straight, run_train(tmp, "resumed", model, encoded, tmp / "work", placement, **settings))


@pytest.fixture(scope="module")
def adapter_runs(request, tmp_path_factory):
    """(family, kind) -> its AdapterRun, for every case of the adapter tests this session runs. The
    trainings start when the module does, AT_ONCE at a time in warm processes (parallel.py) in case order
    (each case's two in turn), so the tests wait on their own case's while the next ones train."""
    cases = selected(request, case_by_test(CASE_TESTS))
    inputs = {family: tuple(request.getfixturevalue(name) for name in FAMILIES[family]) for family in dict(cases)}
    trainings = {(family, kind): partial(train_straight_and_resumed, tmp_path_factory.mktemp(f"{family}-{kind}"),
                                         *inputs[family], ADAPTERS[kind]) for family, kind in cases}
    with started_warm(trainings) as result:
        yield lambda family, kind: result((family, kind))


def published(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*.safetensors"))}


def assert_files_mean_the_adapter(out: Path, model: Path) -> None:
    """The diffusers file, loaded through peft with its recorded config, is the reference: the ComfyUI
    (and kohya) file loaded by ComfyUI's key tables and recomputed by its rules, and (LoRA, DoRA)
    diffusers' own load + fuse, give its merged weights."""
    from diffusers import DiffusionPipeline

    family = families.for_model(model)
    prefix = family.components.denoiser
    for folder in (out, out / "ema"):
        adapter = family.load_denoiser(model, torch.float32)
        add_adapter_from_file(adapter, folder / FILES[0], prefix, "default")
        comfyui = [p for p in folder.glob("*comfyui.safetensors")]
        assert len(comfyui) == 1
        for file in [*comfyui, *folder.glob("*kohya.safetensors")]:  # every key read by ComfyUI, the trained model
            assert_comfyui_applies_the_merged_model(file, adapter, family)
        with safe_open(folder / FILES[0], "pt") as f:
            config = json.loads(f.metadata()["lora_adapter_metadata"])
        if config[f"{prefix}.peft_type"] != "LORA":
            continue
        # SD's kohya file (a plain LoRA's): diffusers' Flux.1 converter splits single blocks at full-size widths
        kohya = folder / "pytorch_lora_weights_kohya.safetensors"
        for file in [FILES[0], *([kohya.name] if kohya.is_file() and prefix == "unet" else [])]:
            pipe = DiffusionPipeline.from_pretrained(model)
            pipe.load_lora_weights(folder, weight_name=file)
            pipe.fuse_lora()
            after = merged(adapter)
            for name in adapted_modules(adapter):
                assert torch.allclose(getattr(pipe, prefix).get_submodule(name).weight, weight(after, name),
                                      atol=1e-5), (file, name)


def check_adapter_run(run: AdapterRun, model: Path) -> None:
    straight, resumed = run.straight, run.resumed
    assert json.loads((resumed / "logs" / "summary.json").read_text())["resumed_from"] == STEPS // 2
    files = published(straight)
    assert {*FILES, *(f"ema/{f}" for f in FILES)} <= set(files)
    assert published(resumed) == files  # the same weights (and EMA) bit for bit
    raw, ema = load_file(straight / FILES[0]), load_file(straight / "ema" / FILES[0])
    assert raw.keys() == ema.keys() and any(not torch.equal(raw[k], ema[k]) for k in raw)
    checkpoint = run.tmp / "work" / "checkpoints" / f"step-{STEPS:06d}"
    with safe_open(checkpoint / "ema.safetensors", "pt") as f:
        assert f.metadata()["updates"] == str(STEPS)
    assert_files_mean_the_adapter(straight, model)


@pytest.mark.parametrize("kind", [k if k in ("lokr", "pissa") else pytest.param(k, marks=pytest.mark.slow)
                                  for k in ADAPTERS])  # lora's resume is also in test_train.py
def test_sd_adapter_trains_with_ema_resumes_exactly_and_exports(kind, adapter_runs, tiny_model):
    check_adapter_run(adapter_runs("sd", kind), tiny_model)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dora", "lokr", "loha", "olora"])
def test_flux_adapter_trains_with_ema_resumes_exactly_and_exports(kind, adapter_runs, flux_model):
    check_adapter_run(adapter_runs("flux", kind), flux_model)


KEYED_BEFORE_ISSUE_16 = {  # TrainParams().model_dump(mode="json") at ef5559f, before issue 16's settings
    "alpha": 4.0, "batch_size": 4, "caption_dropout": 0.0, "checkpoint_every": 100, "dropout": 0.0,
    "gradient_accumulation_steps": 1, "guidance": 1.0, "init_lora": None, "keep_checkpoints": 2,
    "learning_rate": 0.0001, "loss_weighting": "none", "lr_scheduler": "constant", "max_grad_norm": 1.0,
    "max_steps": 1000, "mixed_precision": "no", "noise_offset": 0.0, "num_processes": 1, "optimizer": "adamw",
    "prediction_type": None, "rank": 4, "scale_lr": False, "seed": 0, "snr_gamma": None,
    "target_modules": "attention", "timestep_sampling": {
        "base_shift": None, "distribution": "uniform", "logit_mean": 0.0, "logit_std": 1.0, "max_shift": None,
        "mode_scale": 1.29, "shift": "model", "shift_steps": None, "shift_value": None, "sigmoid_scale": 1.0},
    "warmup_steps": 0, "weight_decay": 0.01}


def test_a_plain_lora_keeps_its_train_key():
    """Every setting added since (adapter, EMA, quantised base, loss options) is left out of the keyed
    dump at its default, so every run made before them keeps its key; set, they are keyed."""
    assert train.TrainParams().model_dump(mode="json") == KEYED_BEFORE_ISSUE_16
    assert train.TrainParams(adapter="lokr").model_dump(mode="json")["adapter"] == "lokr"
    assert train.TrainParams(ema_decay=0.9, ema_every=2).model_dump(mode="json")["ema_every"] == 2


@pytest.mark.parametrize("settings, file_kind, message", [
    ({"adapter": "lokr"}, "lora", r"train.init_lora: .* holds a lora adapter but train.adapter is lokr"),
    ({"init": "pissa"}, "lora", r"train.init_lora: a pissa adapter starts from the base weights' principal"),
    ({"adapter": "loha", "alpha": 2.0}, "loha", r"train.init_lora: .* has alpha 3.0 but train.alpha is 2.0"),
])
def test_init_lora_that_cannot_load_is_refused_by_name(settings, file_kind, message, tmp_path, tiny_model):
    from lorapipe.stages.lora_formats.diffusers_format import write_diffusers_lora
    from lorapipe.stages.train.adapter import AdapterParams, load_init_lora, peft_config

    family = families.for_model(tiny_model)
    written = family.load_denoiser(tiny_model, torch.float32)
    targets = family.lora_target_modules(written, "attention")
    written.add_adapter(peft_config(AdapterParams(adapter=file_kind, rank=2, alpha=3.0), targets))
    write_diffusers_lora(written, tmp_path / "init.safetensors", {}, "unet")
    params = train.TrainParams(**{"rank": 2, "alpha": 3.0, **settings})
    unet = family.load_denoiser(tiny_model, torch.float32)
    unet.add_adapter(peft_config(params, targets))
    with pytest.raises(ValueError, match=message):
        load_init_lora(unet, tmp_path / "init.safetensors", params, "unet")


def test_init_lora_starts_a_lokr_from_a_lokr_file(adapter_runs, tmp_path, tiny_model, encoded):
    first = adapter_runs("sd", "lokr").straight
    again = run_train(tmp_path, "again", tiny_model, encoded, tmp_path / "w2", adapter="lokr", max_steps=2,
                      init_lora=str(first / FILES[0]))
    losses = [[json.loads(line)["loss"] for line in (out / "logs" / "loss.jsonl").read_text().splitlines()]
              for out in (first, again)]
    assert losses[1][0] != losses[0][0]  # step 1 scored the loaded adapter, not a fresh one
