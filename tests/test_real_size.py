"""benchmarks/real_size.py on the tiny SD1.5 model, stored in bf16 as published models are: the command a
real-size row is measured with runs every stage through `lorapipe run` and prints every figure (per
stage its peak resident memory and seconds, per component its parameters and the dtypes it was stored
and ran in, the training steps' seconds), leaving BENCHMARKS.md alone; and a stage whose processes pass
the memory limit is stopped and said so, the stages after it not run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import real_size

pytestmark = pytest.mark.usefixtures("on_kept_prefect_server")  # its commands' flows: tests/prefect_server.py

REPO = Path(__file__).resolve().parent.parent
STAGES = ["build", "preprocess", "encode", "train", "evaluate"]


def _with_tiny_model(root: Path, tiny_model: Path) -> Path:
    """ROOT holding the session's tiny SD1.5 where the bench keeps its model (it only reads it)."""
    (root / "models").mkdir(parents=True)
    (root / "models" / "sd15-tiny").symlink_to(tiny_model)
    return root


def _with_tiny_model_in_bf16(root: Path, tiny_model: Path) -> Path:
    """ROOT holding the session's tiny SD1.5 saved in bf16 where the bench keeps its model: real-size
    weights are stored in bf16, which the tiny model's float32 hid from evaluate."""
    import torch
    from diffusers import DiffusionPipeline

    DiffusionPipeline.from_pretrained(tiny_model).to(torch.bfloat16).save_pretrained(root / "models" / "sd15-tiny")
    return root


@pytest.mark.slow
def test_the_bench_runs_every_stage_and_prints_every_figure(tmp_path, tiny_model):
    benchmarks_md = REPO / "BENCHMARKS.md"
    before = benchmarks_md.read_bytes()
    root = _with_tiny_model_in_bf16(tmp_path, tiny_model)
    run = subprocess.run([sys.executable, "-m", "benchmarks.real_size", "--arch", "sd15", "--tiny", "--resolution", "64",
                          "--steps", "2", "--root", str(root), "--json"],
                         cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    document = json.loads(run.stdout)
    assert [row["stage"] for row in document["stages"]] == STAGES
    assert document["stages"][0]["status"] == "reused"
    for row in document["stages"][1:]:
        assert row["status"] == "completed", row
        assert row["peak_resident_mib"] > 100 and row["seconds"] > 0, row  # a Python process with torch at least
        assert 0 < row["peak_anonymous_mib"] <= row["peak_resident_mib"], row
    components = document["components"]
    assert set(components) == {"text_encoder", "unet", "vae"}
    assert all(c["parameters"] > 0 and c["stored_dtype"] == "BF16" for c in components.values())
    assert components["text_encoder"]["encode_dtype"] == components["vae"]["encode_dtype"] == "bfloat16"
    assert components["unet"]["train_dtype"] == "bfloat16" and "encode_dtype" not in components["unet"]
    steps = document["train_steps"]
    assert steps["steps"] == 2 and len(steps["step_seconds"]) == 2 and all(s > 0 for s in steps["step_seconds"])
    assert benchmarks_md.read_bytes() == before


def test_a_stage_past_the_memory_limit_is_stopped_and_the_rest_not_run(tmp_path, tiny_model):
    root = _with_tiny_model(tmp_path, tiny_model)
    bench = real_size.Bench("sd15", 64, 0, 1, "none", "bfloat16", tiny=True, max_resident_mib=40)  # less than Python with torch
    document = real_size.measure(bench, root)
    statuses = {row["stage"]: row["status"] for row in document["stages"]}
    assert statuses == {"build": "reused", "preprocess": "stopped: its resident memory passed --max-resident-gib",
                        "encode": "not run: preprocess did not complete", "train": "not run: preprocess did not complete",
                        "evaluate": "not run: preprocess did not complete"}
    assert document["stages"][1]["peak_resident_mib"] > 40
    assert document["train_steps"] == {}


def _tiny_arch(root: Path, tiny_model: Path) -> Path:
    """The tiny SD1.5's configs laid out as stages/assets/arch ships them, and its tokenizer where
    random_model takes one: ROOT/arch."""
    import shutil

    shutil.copytree(tiny_model, root / "arch", ignore=shutil.ignore_patterns("*.safetensors", "tokenizer"))
    (root / "models").mkdir()
    (root / "models" / "tiny-sd15").symlink_to(tiny_model)
    return root / "arch"


def _render(pipe, output_type: str = "np"):
    """The tiny SD1.5 pipeline's render of one prompt at 64 px, 2 steps, seed 0: its batch."""
    import torch

    return pipe(prompt=["a cat"], generator=[torch.Generator().manual_seed(0)], num_inference_steps=2, height=64,
                width=64, output_type=output_type)[0]


def test_the_text_stage_is_stored_in_its_own_dtype_and_encode_and_evaluate_load_it_so(tmp_path, tiny_model):
    """`--text-encoder-dtype bfloat16` with `--dtype float32`: random_model stores the text encoder in
    bf16 and the rest in float32, and encode's loaders take them so: a text encoder as stored, the VAE
    in float32 (what lets a float32 row keep T5-XXL or Qwen2.5-VL in bf16). So does evaluate's pipeline
    (it cast the whole pipeline to the denoiser's float32: the real-size Wan 2.1's UMT5-XXL at 21 GiB),
    and it renders what the pipeline cast to float32 renders, to float rounding."""
    import torch

    from benchmarks.common import random_model
    from lorapipe.stages.families import for_model
    from lorapipe.stages.families.folders import load_component
    from lorapipe.stages.sources.inventory import stored_dtype

    model = random_model(_tiny_arch(tmp_path, tiny_model), tmp_path / "models" / "sd15-float32-text-bfloat16",
                         torch.device("cpu"), "float32", "bfloat16")
    assert {name: stored_dtype(model / name) for name in ("text_encoder", "unet", "vae")} == \
        {"text_encoder": "bfloat16", "unet": "float32", "vae": "float32"}
    assert next(load_component(model, "text_encoder").parameters()).dtype == torch.bfloat16
    assert next(for_model(model).load_latent_encoder(model, "cpu").vae.parameters()).dtype == torch.float32

    from lorapipe.stages.evaluate.evaluation import EvalOptions, _load_pipeline
    from lorapipe.stages.families.modular import load_render_pipeline

    pipe = _load_pipeline(model, for_model(model), EvalOptions())
    assert {name: pipe.components[name].dtype for name in ("text_encoder", "unet", "vae")} == \
        {"text_encoder": torch.bfloat16, "unet": torch.float32, "vae": torch.float32}
    cast_whole = _render(load_render_pipeline(model, for_model(model), torch.float32, "cpu"))[0]
    assert np.abs(_render(pipe)[0] - cast_whole).max() * 255 < 2  # 0.64 levels measured


def test_evaluate_decodes_with_the_vae_as_stored_beside_a_bf16_denoiser(tmp_path, tiny_model):
    """`--dtype bfloat16 --vae-dtype float32`: random_model stores the VAE in float32 beside the bf16
    denoiser (as Wan's is, which its pipeline's examples load in float32); evaluate keeps it in float32,
    the denoiser in bf16, and renders the latents of the pipeline whose VAE is cast to bf16 decoded in
    float32, to float rounding."""
    import torch

    from benchmarks.common import random_model
    from lorapipe.stages.evaluate.evaluation import EvalOptions, _load_pipeline
    from lorapipe.stages.sources.inventory import stored_dtype
    from lorapipe.stages.families import for_model
    from lorapipe.stages.families.modular import load_render_pipeline

    model = random_model(_tiny_arch(tmp_path, tiny_model), tmp_path / "models" / "sd15-bfloat16-text-float32-vae-float32",
                         torch.device("cpu"), "bfloat16", "float32", "float32")
    assert {name: stored_dtype(model / name) for name in ("text_encoder", "unet", "vae")} == \
        {"text_encoder": "float32", "unet": "bfloat16", "vae": "float32"}
    pipe = _load_pipeline(model, for_model(model), EvalOptions())
    assert {name: pipe.components[name].dtype for name in ("text_encoder", "unet", "vae")} == \
        {"text_encoder": torch.float32, "unet": torch.bfloat16, "vae": torch.float32}

    cast = load_render_pipeline(model, for_model(model), {"default": torch.bfloat16, "text_encoder": torch.float32},
                                "cpu")
    assert cast.vae.dtype == torch.bfloat16
    latents = _render(cast, "latent").float() / pipe.vae.config.scaling_factor
    with torch.no_grad():
        decoded = pipe.image_processor.postprocess(pipe.vae.decode(latents).sample, output_type="np")[0]
    assert np.abs(_render(pipe)[0] - decoded).max() * 255 < 1


def test_keep_cache_keeps_the_last_runs_cache_and_nothing_else(tmp_path):
    """`--keep-cache` (a row's later stages rerun without its hour of encoding) keeps ROOT/run/cache and
    empties the rest of the run's folder; without it the cache goes too. `--gradient-checkpointing`
    reaches the config's train section."""
    import yaml

    def rerun(keep_cache: bool) -> Path:
        bench = real_size.Bench("sd15", 64, 0, 1, "none", "float32", True, None, gradient_checkpointing=True,
                                keep_cache=keep_cache)
        return real_size.write_config(bench, tmp_path, tmp_path / "models" / "sd15-tiny")

    config = rerun(keep_cache=False)
    (config.parent / "cache" / "encode").mkdir(parents=True)
    (config.parent / "encode.out").write_text("the last run's log")
    config = rerun(keep_cache=True)
    assert (config.parent / "cache" / "encode").is_dir() and not (config.parent / "encode.out").exists()
    assert yaml.safe_load(config.read_text())["train"]["gradient_checkpointing"] is True
    assert not (rerun(keep_cache=False).parent / "cache").exists()
