"""Train on the base, preview on the distilled checkpoint. On the tiny Z-Image (base) trained through
the real stages, evaluate.render_model renders the grid with the tiny Z-Image Turbo with its own
steps (9) and no guidance, while the held-out losses are the training model's, unchanged; the
rendering model is part of evaluate's key; a model of another family is refused in one line.
Training directly on Turbo warns once, naming the base to train on."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_invalidation import make_config, run_all, statuses

from lorapipe.cache.errors import UserError
from lorapipe.flows.steps import STAGES, Context
from lorapipe.flows.runner import explain

pytestmark = pytest.mark.slow

TRAIN = {"max_steps": 2, "checkpoint_every": 2, "log_every": 2}
EVALUATE = {"num_inference_steps": None, "lora_scales": [1.0]}  # the rendering model's own steps
TURBO_STEPS = 9


@pytest.fixture(scope="module")
def trained_zimage(tmp_path_factory, zimage_model, demo_images):
    """A Z-Image base LoRA and its evaluation rendered by the training model (2 steps)."""
    root = tmp_path_factory.mktemp("zimage-trained")
    shutil.copytree(demo_images, root / "data")
    config = make_config(root, zimage_model, root / "data", root / "cache", train=TRAIN,
                         evaluate={"lora_scales": [1.0]})
    lines = []
    results = run_all(config, log=lines.append)
    assert statuses(results)["evaluate"] == "computed"
    assert not [line for line in lines if "distilled" in line]  # the base trains without a warning
    return root, json.loads((Path(results["evaluate"].path) / "metrics.json").read_text())


def config_rendering_with(root: Path, model: Path, render_model: Path):
    return make_config(root, model, root / "data", root / "cache", train=TRAIN,
                       evaluate={**EVALUATE, "render_model": str(render_model)})


def test_turbo_renders_the_grid_with_its_steps_and_the_losses_stay_on_the_base(
        trained_zimage, zimage_model, zimage_turbo_model):
    root, rendered_by_base = trained_zimage
    config = config_rendering_with(root, zimage_model, zimage_turbo_model)
    row = next(r for r in explain(Context(config), STAGES) if r["stage"] == "evaluate")
    assert row["status"] == "miss" and "render_model" in row["reason"]
    calls = []  # the folder of each transformer call's weights

    def hook(module, args, output):
        if type(module).__name__ == "ZImageTransformer2DModel":
            calls.append(Path(module.config._name_or_path).parent)

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        results = run_all(config)
    finally:
        handle.remove()
    assert statuses(results) == {"preprocess": "hit", "encode": "hit", "train": "hit", "evaluate": "computed"}
    # Turbo first: the base column and the LoRA column, one call a step (no guidance); then only the base
    assert calls[:2 * TURBO_STEPS] == [zimage_turbo_model] * (2 * TURBO_STEPS)
    assert set(calls[2 * TURBO_STEPS:]) == {zimage_model}
    metrics = json.loads((Path(results["evaluate"].path) / "metrics.json").read_text())
    assert metrics["loss"] == rendered_by_base["loss"]


def test_a_render_model_of_another_family_is_refused_in_one_line(trained_zimage, zimage_model, tiny_model):
    root, _ = trained_zimage
    with pytest.raises(UserError, match=r"^evaluate\.render_model: .* is a .* model, but the LoRA is trained on"
                                        r" Z-Image .*same family$") as refused:
        run_all(config_rendering_with(root, zimage_model, tiny_model))
    assert "\n" not in str(refused.value)


def test_training_on_turbo_warns_once_naming_the_base(trained_zimage, zimage_turbo_model):
    root, _ = trained_zimage
    config = make_config(root, zimage_turbo_model, root / "data", root / "cache", train=TRAIN)
    lines = []
    results = run_all(config, STAGES[:3], log=lines.append)
    assert statuses(results)["train"] == "computed"
    warnings = [line for line in lines if "warning" in line]
    assert len(warnings) == 1 and "distilled Z-Image" in warnings[0] and "Tongyi-MAI/Z-Image," in warnings[0]
