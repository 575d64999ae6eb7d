"""train.adapter and the EMA through the real train stage on the tiny Flux.2-klein, Z-Image,
Qwen-Image, Qwen-Image 2.1, Krea 2 and Ideogram 4 models, as tests/test_train_adapters.py does for SD1.x and
Flux.1: each adapter type trains with an EMA, a run resumed from the halfway checkpoint publishes the
same files byte for byte, and every published file (trained and EMA) means the trained adapter. The
reference is the model as training left it, rebuilt from the last checkpoint as a resumed run
rebuilds it (a PiSSA/OLoRA base minus its saved start); a file's effect on the weights must equal
that model's merged weights: loaded by diffusers' own loader (load_lora_weights + fuse_lora) where
diffusers reads the format, else by peft (LoKr/LoHa diffusers files); and every ComfyUI (and kohya)
file read through ComfyUI's key tables (tests/comfyui_keys.py) and recomputed by its rules, its
LyCORIS key set checked too.

One run per (family, adapter) is trained once per module and shared by its tests; 2 steps with a
checkpoint after each. A resumed run (a second launch) is trained for two types per family (one for
Qwen-Image 2.1, Krea 2 and Ideogram 4: REAL_RESUME); every type's halfway checkpoint also goes
through what a resume does with it, in process (test_checkpoint_round_trips_bit_for_bit)."""
from __future__ import annotations

import copy
import json
import re
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest
import torch
from comfyui_keys import assert_comfyui_applies_the_merged_model
from family_checks import fused_change, merged, weight, quiet_pipeline
from parallel import case_by_test, selected, started_warm
from safetensors import safe_open
from safetensors.torch import load_file
from test_adapters import documented_keys, exported_comfyui_file, per_module, trained_adapter
from test_train_adapters import published, train_straight_and_resumed
from test_train_adapters import run_train as train_once

from lorapipe.stages import families, train
from lorapipe.stages.lora_formats.diffusers_format import add_adapter_from_file
from lorapipe.stages.lora_formats.lycoris import adapted_modules
from lorapipe.stages.processes.placement import Placement
from lorapipe.stages.train.adapter import AdapterParams
from lorapipe.stages.train.trained_adapter import INITIAL_FILE, TrainedAdapter

STEPS = 2
PARAMS = dict(rank=2, alpha=3.0, learning_rate=1e-2, batch_size=2, max_steps=STEPS, checkpoint_every=1,
              keep_checkpoints=2, seed=1, ema_decay=0.5)
ADAPTERS = {"lora": {}, "dora": {"adapter": "dora", "rslora": True}, "lokr": {"adapter": "lokr"},
            "loha": {"adapter": "loha"}, "pissa": {"init": "pissa"}, "olora": {"init": "olora", "rslora": True}}
# a LoKr cannot be split by rows: on Flux.2, where q/k/v are fused in the original layout, it trains on
# whole modules (the attention preset is refused: test_lokr_on_fused_modules_is_refused...), as on
# Ideogram 4 (its attention.qkv); Z-Image's,
# the Qwen-Images' and Krea 2's ComfyUI files name q/k/v apart
WHOLE_MODULES = {"flux2-klein": ("attn.to_out.0", "attn.to_add_out", "attn.to_qkv_mlp_proj"),
                 "z-image": "attention", "qwen-image": "attention", "qwen-image-2.1": "attention", "krea2": "attention",
                 "ideogram4": ("attention.to_out.0", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")}
# where diffusers 0.42.1's load_lora_weights reads a LoKr/LoHa: the diffusers file of a LoKr on Flux.2 and
# Z-Image, and their ComfyUI LoKr files (it reads no LoHa); a DoRA ComfyUI file loads with its dora_scale
# dropped, so it is read through ComfyUI's key tables only
DIFFUSERS_READS = {("flux2-klein", "lokr"), ("z-image", "lokr")}
DIFFUSERS_READS_COMFYUI = DIFFUSERS_READS
FAMILIES = ("flux2-klein", "z-image", "qwen-image", "qwen-image-2.1", "krea2", "ideogram4")
# the cases whose halfway checkpoint a second launch resumes (the others' resume runs in process): each
# type once, where its checkpoint's names are least usual: Flux.2's DoRA (a magnitude on the single
# blocks' bare to_out) and LoKr (on the fused to_qkv_mlp_proj), Z-Image's PiSSA (the saved start, on
# separate q/k/v of a fused original) and LoHa, Qwen-Image's OLoRA with rsLoRA and plain LoRA, Qwen-Image
# 2.1's DoRA (a magnitude on its single-stream blocks), Krea 2's DoRA (a magnitude on the gated
# attention's to_gate), Ideogram 4's LoKr (on whole modules: its feed-forward and attention output)
REAL_RESUME = {("flux2-klein", "dora"), ("flux2-klein", "lokr"), ("z-image", "pissa"), ("z-image", "loha"),
               ("qwen-image", "olora"), ("qwen-image", "lora"), ("qwen-image-2.1", "dora"), ("krea2", "dora"),
               ("ideogram4", "lokr")}
LORA_FILE, COMFYUI_FILE, KOHYA_FILE = ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_comfyui.safetensors",
                                       "pytorch_lora_weights_kohya.safetensors")


@pytest.fixture(scope="module")
def models(request) -> dict:
    """family -> (tiny model, encoded set), built when a test first asks for the family."""
    fixtures = {"flux2-klein": ("flux2_model", "flux2_encoded"), "z-image": ("zimage_model", "zimage_encoded"),
                "qwen-image": ("qwenimage_model", "qwenimage_encoded"),
                "qwen-image-2.1": ("qwenimage21_model", "qwenimage21_encoded"),
                "krea2": ("krea2_model", "krea2_encoded"),
                "ideogram4": ("ideogram4_model", "ideogram4_encoded")}
    return {name: (lambda m=m, e=e: (request.getfixturevalue(m), request.getfixturevalue(e)))
            for name, (m, e) in fixtures.items()}


def settings(family: str, kind: str) -> dict:
    return {**ADAPTERS[kind], "target_modules": WHOLE_MODULES[family] if kind == "lokr" else "attention"}


def run_train(root: Path, name: str, model: Path, encoded, placement: Placement | None = None, **overrides) -> Path:
    return train_once(root, name, model, encoded, root / f"work-{name}", placement, **{**PARAMS, **overrides})


def checkpoint(work: Path, step: int) -> Path:
    return work / "checkpoints" / f"step-{step:06d}"


@dataclass(frozen=True)
class Run:
    model: Path
    straight: Path  # the straight run's output
    work: Path  # the straight run's work dir
    resumed: Path | None  # the resumed run's output (REAL_RESUME cases)


def train_case(root: Path, model: Path, encoded, family: str, kind: str, placement: Placement) -> Run:
    """Straight for STEPS steps; for REAL_RESUME, also resumed from its halfway checkpoint in a fresh
    work dir (what a run killed after that checkpoint leaves)."""
    if (family, kind) in REAL_RESUME:
        both = train_straight_and_resumed(root, model, encoded, {**PARAMS, **settings(family, kind)}, placement)
        return Run(model, both.straight, root / "work-straight", both.resumed)
    straight = run_train(root, "straight", model, encoded, placement, **settings(family, kind))
    return Run(model, straight, root / "work-straight", None)


CASE_TESTS = dict.fromkeys(  # the tests that take a run: their parameters -> its (family, kind)
    ("test_adapter_trains_with_an_ema", "test_resumed_run_publishes_the_same_files",
     "test_checkpoint_round_trips_bit_for_bit", "test_every_exported_file_means_the_trained_model",
     "test_kohya_metadata_states_the_exported_rank_and_scale"), lambda params: (params["family"], params["kind"]))


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, models):
    """(family, adapter) -> its Run, for every case this session's tests need: the trainings start
    with the module, two at a time in warm processes (parallel.py), in case order, so a test waits on
    its own case's while the next ones train."""
    cases = selected(request, case_by_test(CASE_TESTS))
    inputs = {family: models[family]() for family in dict(cases)}
    trainings = {(family, kind): partial(train_case, tmp_path_factory.mktemp(f"{family}-{kind}"), *inputs[family],
                                         family, kind) for family, kind in cases}
    with started_warm(trainings) as result:
        yield lambda family, kind: result((family, kind))


def resumed_model(model: Path, family: str, kind: str, saved: Path) -> tuple[torch.nn.Module, TrainedAdapter]:
    """The denoiser and its adapter (with its EMA) rebuilt from checkpoint `saved` as a resumed run
    rebuilds them (stages/train/recipe.py: add_to with a PiSSA/OLoRA start, start_ema, load)."""
    fam = families.for_model(model)
    params = train.TrainParams(**{**PARAMS, **settings(family, kind)})
    denoiser = fam.load_denoiser(model, torch.float32)
    adapter = TrainedAdapter(params, fam, fam.lora_target_modules(denoiser, params.target_modules))
    adapter.add_to(denoiser, TrainedAdapter.saved_start(saved) if params.init != "default" else None)
    adapter.start_ema(denoiser)
    adapter.load(denoiser, saved)
    return denoiser, adapter


def trained_model(model: Path, work: Path, family: str, kind: str, ema: bool) -> torch.nn.Module:
    """The denoiser with its adapter as training left it (the EMA's weights if `ema`), rebuilt from the
    last checkpoint as a resumed run rebuilds it."""
    denoiser, adapter = resumed_model(model, family, kind, checkpoint(work, STEPS))
    with ExitStack() as stack:
        if ema:
            stack.enter_context(adapter.ema.swapped_in())
        return copy.deepcopy(denoiser)



def assert_fused_means(model: Path, lora: Path | dict, expected: torch.nn.Module, adapted: list[str]) -> None:
    """diffusers' load_lora_weights + fuse_lora of `lora` in a fresh pipeline gives every adapted
    module the expected (merged) weight and leaves every other Linear as it was."""
    pipe = quiet_pipeline(model)
    base = {n: m.weight.detach().clone() for n, m in pipe.transformer.named_modules() if isinstance(m, torch.nn.Linear)}
    for name, delta in fused_change(pipe, "transformer", lora).items():
        want = weight(expected, name) if name in adapted else base[name]
        assert torch.allclose(base[name] + delta, want, atol=1e-5), name


FAST_CASES = {("flux2-klein", "lokr"), ("z-image", "pissa"), ("qwen-image", "dora"), ("qwen-image-2.1", "lora"),
              ("krea2", "loha"), ("ideogram4", "dora")}
CASES = [pytest.param(f, k, id=f"{f}-{k}", marks=[] if (f, k) in FAST_CASES else [pytest.mark.slow])
         for f in FAMILIES for k in ADAPTERS]


@pytest.mark.parametrize("family, kind", CASES)
def test_adapter_trains_with_an_ema(family, kind, runs):
    run = runs(family, kind)
    files = published(run.straight)
    assert {LORA_FILE, COMFYUI_FILE, f"ema/{LORA_FILE}", f"ema/{COMFYUI_FILE}"} <= set(files)
    raw, ema = load_file(run.straight / LORA_FILE), load_file(run.straight / "ema" / LORA_FILE)
    assert raw.keys() == ema.keys() and any(not torch.equal(raw[k], ema[k]) for k in raw)
    with safe_open(checkpoint(run.work, STEPS) / "ema.safetensors", "pt") as f:
        assert f.metadata()["updates"] == str(STEPS)
    assert (checkpoint(run.work, STEPS) / INITIAL_FILE).is_file() == (kind in ("pissa", "olora"))


@pytest.mark.parametrize("family, kind", [c for c in CASES if tuple(c.values) in REAL_RESUME])
def test_resumed_run_publishes_the_same_files(family, kind, runs):
    run = runs(family, kind)
    assert json.loads((run.resumed / "logs" / "summary.json").read_text())["resumed_from"] == STEPS // 2
    assert published(run.resumed) == published(run.straight)  # the same weights (and EMA) bit for bit


@pytest.mark.parametrize("family, kind", CASES)
def test_checkpoint_round_trips_bit_for_bit(family, kind, runs, tmp_path):
    """What a resume does with a checkpoint, in process: the model rebuilt from the halfway checkpoint
    as a resumed run rebuilds it saves that checkpoint's files again byte for byte (nothing loaded was
    dropped or renamed), and a fresh denoiser loading those holds every tensor (and the EMA) bit for bit."""
    run = runs(family, kind)
    halfway = checkpoint(run.work, STEPS // 2)
    denoiser, adapter = resumed_model(run.model, family, kind, halfway)
    with safe_open(halfway / LORA_FILE, "pt") as f:
        provenance = {k: v for k, v in f.metadata().items() if k.startswith("lorapipe.")}
    adapter.save(denoiser, tmp_path, provenance)
    assert published(tmp_path) == published(halfway)
    again, adapter_again = resumed_model(run.model, family, kind, tmp_path)
    want, got = denoiser.state_dict(), again.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert adapter_again.ema.updates == adapter.ema.updates == STEPS // 2
    assert all(torch.equal(adapter.ema.average[k], adapter_again.ema.average[k]) for k in adapter.ema.average)


@pytest.mark.parametrize("family, kind", CASES)
@pytest.mark.parametrize("ema", [False, True], ids=["trained", "ema"])
def test_every_exported_file_means_the_trained_model(family, kind, ema, runs):
    run = runs(family, kind)
    model, straight, work = run.model, run.straight, run.work
    folder = straight / "ema" if ema else straight
    trained = trained_model(model, work, family, kind, ema)
    expected, adapted = merged(trained), adapted_modules(trained)
    # the diffusers file: diffusers' own loader where it reads the type (PiSSA/OLoRA as their plain LoRA), else peft
    if kind not in ("lokr", "loha") or (family, kind) in DIFFUSERS_READS:
        assert_fused_means(model, folder / LORA_FILE, expected, adapted)
    else:
        with pytest.raises(ValueError, match=r"Invalid (LoRA|adapter) checkpoint"):
            quiet_pipeline(model).load_lora_weights(folder, weight_name=LORA_FILE)
        fresh = families.for_model(model).load_denoiser(model, torch.float32)
        add_adapter_from_file(fresh, folder / LORA_FILE, "transformer", "default")
        loaded = merged(fresh)
        for name in adapted:
            assert torch.allclose(weight(loaded, name), weight(expected, name), atol=1e-5), name
    # the ComfyUI file (and Flux.2's kohya file): diffusers' own loader reads it as it is for a plain LoRA and
    # a LoKr; ComfyUI reads every key, DoRA, LoKr and LoHa with the documented key set
    comfyui = folder / COMFYUI_FILE
    kohya = [folder / KOHYA_FILE] if (folder / KOHYA_FILE).is_file() else []
    if kind in ("lora", "pissa", "olora") or (family, kind) in DIFFUSERS_READS_COMFYUI:
        for file in [comfyui, *kohya]:
            assert_fused_means(model, file, expected, adapted)
    if kind in ("dora", "lokr", "loha"):
        for original, t in per_module(load_file(comfyui)).items():
            assert set(t) == documented_keys(kind, t), original
    original = families.for_model(model).load_denoiser(model, torch.float32)  # what PiSSA/OLoRA's export applies to
    for file in [comfyui, *kohya]:
        assert_comfyui_applies_the_merged_model(file, trained, families.for_model(model), original)


@pytest.mark.parametrize("family, kind", [c for c in CASES if c.values[1] in ("dora", "pissa", "olora")])
def test_kohya_metadata_states_the_exported_rank_and_scale(family, kind, runs):
    """ss_network_dim is the rank the files hold (2r: PiSSA/OLoRA export as a plain LoRA of rank 2r) and
    ss_network_alpha / ss_network_dim is the trained scale (alpha / sqrt(rank) with rsLoRA, which
    kohya's loaders do not know)."""
    straight = runs(family, kind).straight
    settings = ADAPTERS[kind]
    scale = PARAMS["alpha"] / (PARAMS["rank"] ** 0.5 if settings.get("rslora") else PARAMS["rank"])
    with safe_open(straight / LORA_FILE, "pt") as f:
        rank = next(f.get_tensor(k).shape[0] for k in f.keys() if k.endswith("lora_A.weight"))
    with safe_open(straight / COMFYUI_FILE, "pt") as f:
        metadata = f.metadata()
    assert int(metadata["ss_network_dim"]) == rank == PARAMS["rank"] * (2 if "init" in settings else 1)
    assert float(metadata["ss_network_alpha"]) / rank == pytest.approx(scale, rel=1e-9)


def test_lokr_on_fused_modules_is_refused_before_training_in_one_line(models, tmp_path):
    """Flux.2 fuses q/k/v (double_blocks.N.img_attn.qkv) and ComfyUI has no name for a part of it: a
    LoKr there is refused by the train stage before its first step, in one line naming the key and
    the module (Qwen-Image's modules are whole: its LoKr trains on the attention preset above)."""
    from lorapipe.stages.processes.launching import WorkerFailed

    model, encoded = models["flux2-klein"]()
    with pytest.raises(WorkerFailed) as refused:
        run_train(tmp_path, "lokr", model, encoded, adapter="lokr", target_modules="attention")
    message = str(refused.value)
    assert "\n" not in message
    assert re.search(r"train\.target_modules: transformer_blocks\.0\.attn\.to_q: a LoKr cannot be written on"
                     r" double_blocks\.0\.img_attn\.qkv", message), message
    assert not (tmp_path / "work-lokr" / "logs" / "loss.jsonl").exists()  # not a step spent


def test_zimage_lokr_on_q_k_v_loads_in_diffusers_and_comfyui(zimage_model, tmp_path):
    """Z-Image's ComfyUI file keeps diffusers' module names, which ComfyUI's Z-Image key map points at
    their rows of its fused attention.qkv: a LoKr on q/k/v passes the check training runs first, and
    its ComfyUI file loads in diffusers (load_lora_weights + fuse_lora) and in ComfyUI, each giving the
    trained model."""
    family = families.for_model(zimage_model)
    transformer = trained_adapter(family, zimage_model, AdapterParams(adapter="lokr", rank=2, alpha=3), "attention")
    family.check_adapter(transformer)
    file = exported_comfyui_file(family, transformer, tmp_path)
    assert "diffusion_model.layers.0.attention.to_q.lokr_w1" in load_file(file)
    assert_fused_means(zimage_model, file, merged(transformer), adapted_modules(transformer))
    assert_comfyui_applies_the_merged_model(file, transformer, family)
