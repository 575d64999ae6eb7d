"""`lorapipe demo --arch X` end to end on each tiny family's model other than SD's (FEWER_STEPS):
Flux.1, the 2026 families and the Flux.1 Kontext edit demo. Apart from tests/test_demo.py (the SD
demo as shipped and its reruns) so that the two test workers share the demo runs. Flux.1's and the
2026 families' demos run in one command (`lorapipe demo --arch A --arch B ...`), their reruns in
another: one process, Prefect server and process started ahead for all, as a user's would."""
from __future__ import annotations

import json

import pytest

from conftest import FEWER_STEPS
from test_demo import demo_on_tiny_model, demos_on_tiny_models, lorapipe, several_demos

pytestmark = pytest.mark.slow
# The grid: the base and the LoRA at scale 1, one seed. The 0.5 column and a second seed are rendering
# alone, no check here reads them (the SD demo as shipped renders both, the edit demo below the 0.5 column).
FEWER_SAMPLES = ("--set", "evaluate.lora_scales=[1.0]", "--set", "evaluate.seeds=[0]")


@pytest.fixture(scope="module")
def family_demos(tmp_path_factory, tiny_models):
    """Flux.1's demo and each 2026 family's in one `lorapipe demo` command, each in a workdir named
    after its arch: the folder, the command, each demo's part of its output."""
    root = tmp_path_factory.mktemp("families")
    command, parts = demos_on_tiny_models(["flux1", *LORA_FILES], root, tiny_models, *FEWER_SAMPLES)
    return root, command, parts


def test_flux1_demo_trains_the_tiny_flux_and_its_lora_beats_the_base(tmp_path, family_demos):
    """`lorapipe demo --arch flux1`: the same layout and outputs as the SD demo, on the tiny Flux.1 dev
    (flow matching), trained for the steps its --set says; a workdir already holding another arch's
    model is refused in one line, and the command's next demo still runs."""
    root, command, parts = family_demos
    assert parts["flux1"].error() is None, parts["flux1"].stderr[-3000:]
    assert command.returncode == (1 if any(part.error() for part in parts.values()) else 0)
    outputs = root / "flux1" / "outputs"
    last = json.loads((outputs / "logs" / "loss.jsonl").read_text().splitlines()[-1])
    assert f"train.max_steps={last['step']}" in FEWER_STEPS
    for name in ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_kohya.safetensors",
                 "pytorch_lora_weights_comfyui.safetensors", "grid.png", "metrics.json"):
        assert (outputs / name).is_file()
    metrics = json.loads((outputs / "metrics.json").read_text())
    assert metrics["prediction_type"] == {"base": "flow", "lora": "flow"}
    assert metrics["loss"]["train"]["lora"]["overall"] < metrics["loss"]["train"]["base"]["overall"]
    for arch in ("sd15", "z-image"):  # both workdirs hold the tiny Flux.1
        (tmp_path / "refused" / arch).mkdir(parents=True)
        (tmp_path / "refused" / arch / "model").symlink_to(root / "flux1" / "model")
    other = lorapipe("demo", "--arch", "sd15", "--arch", "z-image", "--workdir", "refused", cwd=tmp_path)
    assert other.returncode == 1
    assert [line for line in other.stderr.splitlines() if "error" in line] == [
        f"lorapipe: error: the {arch} demo: refused/{arch}/model holds the tiny flux1 model, not {arch}: give"
        f" another --workdir for the {arch} demo" for arch in ("sd15", "z-image")]


LORA_FILES = dict.fromkeys(["z-image", "flux2-klein", "flux2-dev", "qwen-image", "qwen-image-2.1", "krea2", "ideogram4",
                            "ernie-image", "chroma", "hidream-i1", "kandinsky5", "flux3", "hunyuanimage2.1"],
                           ("", "_comfyui"))


@pytest.mark.parametrize("arch", list(LORA_FILES))
def test_2026_family_demo_trains_its_tiny_base_and_its_lora_beats_the_base(family_demos, arch):
    """`lorapipe demo --arch X` for each 2026 family end to end through Prefect: variable-length or
    stacked-layer text records, per-family latent normalisation, the family's exports."""
    root, _, parts = family_demos
    assert parts[arch].error() is None, parts[arch].stderr[-3000:]
    outputs = root / arch / "outputs"
    for name in (*(f"pytorch_lora_weights{suffix}.safetensors" for suffix in LORA_FILES[arch]), "grid.png"):
        assert (outputs / name).is_file()
    metrics = json.loads((outputs / "metrics.json").read_text())
    assert metrics["prediction_type"] == {"base": "flow", "lora": "flow"}
    assert metrics["loss"]["train"]["lora"]["overall"] < metrics["loss"]["train"]["base"]["overall"]


@pytest.fixture(scope="module")
def family_reruns(family_demos):
    """The 2026 families' demos again, in one command, after the tests above read the first runs."""
    return several_demos(list(LORA_FILES), family_demos[0], *FEWER_SAMPLES)


@pytest.mark.parametrize("arch", list(LORA_FILES))
def test_2026_family_demo_run_again_is_all_hits(family_demos, family_reruns, arch):
    """The same command again is all hits (the all-hit path: no model code, a second or so)."""
    again, parts = family_reruns
    assert parts[arch].error() is None, parts[arch].stderr[-3000:]
    assert again.returncode == (1 if any(part.error() for part in parts.values()) else 0)
    summary = json.loads((family_demos[0] / arch / "outputs" / "run-summary.json").read_text())
    assert [s["status"] for s in summary["stages"]] == ["hit"] * 4
    assert "demo: building" not in parts[arch].stdout + family_demos[2][arch].stdout  # the workdir's model is used


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
