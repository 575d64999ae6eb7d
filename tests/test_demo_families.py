"""`lorapipe demo --arch X` end to end on each tiny family's model other than SD's (FEWER_STEPS):
Flux.1, the 2026 families and the Flux.1 Kontext edit demo. Apart from tests/test_demo.py (the SD
demo as shipped and its reruns) so that the two test workers share the demo runs."""
from __future__ import annotations

import json

import pytest

from conftest import FEWER_STEPS
from test_demo import demo_on_tiny_model, lorapipe

pytestmark = pytest.mark.slow
# The grid's columns: the base and the LoRA at scale 1. The 0.5 column is rendering alone, no check
# here reads it (the SD demo as shipped and the edit demo below render and check it).
AT_SCALE_1 = ("--set", "evaluate.lora_scales=[1.0]")


def test_flux1_demo_trains_the_tiny_flux_and_its_lora_beats_the_base(tmp_path, tiny_models):
    """`lorapipe demo --arch flux1`: the same layout and outputs as the SD demo, on the tiny Flux.1 dev
    (flow matching), trained for the steps its --set says; a workdir already holding another arch's
    model is refused in one line."""
    run = demo_on_tiny_model("flux1", tmp_path / "flux", tiny_models, *AT_SCALE_1)
    assert run.returncode == 0, run.stderr[-3000:]
    outputs = tmp_path / "flux" / "outputs"
    last = json.loads((outputs / "logs" / "loss.jsonl").read_text().splitlines()[-1])
    assert f"train.max_steps={last['step']}" in FEWER_STEPS
    for name in ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_kohya.safetensors",
                 "pytorch_lora_weights_comfyui.safetensors", "grid.png", "metrics.json"):
        assert (outputs / name).is_file()
    metrics = json.loads((outputs / "metrics.json").read_text())
    assert metrics["prediction_type"] == {"base": "flow", "lora": "flow"}
    assert metrics["loss"]["train"]["lora"]["overall"] < metrics["loss"]["train"]["base"]["overall"]
    other = lorapipe("demo", "--arch", "sd15", "--workdir", "flux", cwd=tmp_path)
    assert other.returncode == 1
    assert other.stderr.strip().splitlines()[-1] == ("lorapipe: error: flux/model holds the tiny flux1 model, not sd15:"
                                                     " give another --workdir for the sd15 demo")


LORA_FILES = {**dict.fromkeys(["z-image", "flux2-klein", "flux2-dev", "qwen-image", "qwen-image-2.1", "krea2",
                                "ideogram4", "ernie-image", "chroma", "hidream-i1", "kandinsky5", "flux3"],
                                ("", "_comfyui")),
              "hunyuanimage2.1": ("",)}  # the diffusers file alone


@pytest.mark.parametrize("arch", list(LORA_FILES))
def test_2026_family_demo_trains_its_tiny_base_and_its_lora_beats_the_base(tmp_path, tiny_models, arch):
    """`lorapipe demo --arch X` for each 2026 family end to end through Prefect: variable-length or
    stacked-layer text records, per-family latent normalisation, the family's exports; the same command
    again is all hits (the all-hit path: no model code, a second or so)."""
    run = demo_on_tiny_model(arch, tmp_path / "run", tiny_models, *AT_SCALE_1)
    assert run.returncode == 0, run.stderr[-3000:]
    outputs = tmp_path / "run" / "outputs"
    for name in (*(f"pytorch_lora_weights{suffix}.safetensors" for suffix in LORA_FILES[arch]), "grid.png"):
        assert (outputs / name).is_file()
    metrics = json.loads((outputs / "metrics.json").read_text())
    assert metrics["prediction_type"] == {"base": "flow", "lora": "flow"}
    assert metrics["loss"]["train"]["lora"]["overall"] < metrics["loss"]["train"]["base"]["overall"]
    again = lorapipe("demo", "--arch", arch, "--workdir", "run", *FEWER_STEPS, *AT_SCALE_1, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads((outputs / "run-summary.json").read_text())
    assert [s["status"] for s in summary["stages"]] == ["hit"] * 4
    assert "demo: building" not in run.stdout + again.stdout  # the model in the workdir is used as it is


def test_edit_demo_trains_kontext_on_generated_pairs_and_renders_the_edit_grid(tmp_path, tiny_models):
    """`lorapipe demo --arch flux1-kontext`: the bundled photos and the same photos with a red hat, as
    edit pairs; the LoRA beats the base on held-out pairs scored with their reference tokens, and
    edit_grid.png shows reference | base | LoRA | target."""
    run = demo_on_tiny_model("flux1-kontext", tmp_path / "run", tiny_models)
    assert run.returncode == 0, run.stderr[-3000:]
    outputs = tmp_path / "run" / "outputs"
    assert (outputs / "edit_grid.png").is_file() and "edit grid:" in run.stdout
    metrics = json.loads((outputs / "metrics.json").read_text())
    assert metrics["edit"]["pairs"] == 2 and set(metrics["edit"]["pixel_mse_to_target"]) == {"base", "LoRA x0.5",
                                                                                            "LoRA x1"}
    assert metrics["loss"]["holdout"]["lora"]["overall"] < metrics["loss"]["holdout"]["base"]["overall"]
