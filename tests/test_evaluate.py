"""The evaluate stage on the tiny model and the encoded demo photos: real components, no mocks.

The LoRA is made here (random nonzero weights, saved the way the train stage saves them) so these
tests do not depend on training.
"""
from __future__ import annotations

import json
import math
import re
import shutil
from contextlib import nullcontext
from pathlib import Path

import pytest
from PIL import Image, ImageChops
from pydantic import ValidationError

from conftest import LIBRARY_WARNINGS_SHOWN
from lorapipe.stages.evaluate import EvalInputs, EvalParams, run
from lorapipe.stages.evaluate.render import HEADER_HEIGHT, LABEL_WIDTH, cell

FAST = dict(
    prompts=("a photo of a cat on a windowsill", "a rocket"), seeds=(0, 1), lora_scales=(0.0, 1.0),
    num_inference_steps=2, loss_timesteps=(100, 500, 900),
)
DATA_FILES = ("grid.png", "metrics.json", "report.md", "checkpoint_losses.json", "checkpoint_loss.png")


def _save_lora(pipe_cls, unet, out_dir: Path, factor: float) -> None:
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft import get_peft_model_state_dict

    peft_layers = {k: v * factor if "lora_B" in k else v for k, v in get_peft_model_state_dict(unet).items()}
    pipe_cls.save_lora_weights(
        out_dir, unet_lora_layers=convert_state_dict_to_diffusers(peft_layers),
        unet_lora_adapter_metadata=unet.peft_config["default"].to_dict(),
    )


@pytest.fixture(scope="session")
def lora_dir(tmp_path_factory, tiny_model) -> Path:
    """Shaped like a train artifact: a LoRA with nonzero weights and two checkpoints of it."""
    import torch
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel
    from peft import LoraConfig

    unet = UNet2DConditionModel.from_pretrained(tiny_model, subfolder="unet")
    unet.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    generator = torch.Generator().manual_seed(0)
    for name, param in unet.named_parameters():
        if "lora_B" in name:  # peft initialises B to zero, which would make the LoRA a no-op
            param.data = torch.randn(param.shape, generator=generator) * 0.3
    out = tmp_path_factory.mktemp("train-artifact")
    _save_lora(StableDiffusionPipeline, unet, out, 1.0)
    for step, factor in ((10, 0.3), (20, 0.7)):
        _save_lora(StableDiffusionPipeline, unet, out / "checkpoints" / f"step-{step:06d}", factor)
    return out


def _evaluate(params: EvalParams, tiny_model: Path, lora_dir: Path, encoded, out: Path, placement=None):
    out.mkdir(parents=True)
    inputs = EvalInputs(
        tiny_model, lora_dir, encoded.artifact_dir, encoded.cache_root,
        base_model_digest="base-digest", encoded_digest=encoded.digest, lora_digest="lora-digest",
    )
    return run(params, inputs, out, out.parent / f"{out.name}-work", log=lambda message: None, placement=placement)


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, tiny_model, lora_dir, encoded) -> tuple[Path, EvalParams, dict]:
    root = tmp_path_factory.mktemp("evaluate")
    params = EvalParams(**FAST, clip_model=str(root / "no-such-clip"))
    built = _evaluate(params, tiny_model, lora_dir, encoded, root / "first")
    return root / "first", params, built.info


def test_an_evaluation_in_the_process_started_ahead_writes_the_same_files(evaluated, tmp_path, tiny_model,
                                                                           lora_dir, encoded):
    """A run that trains hands evaluate's job to the warm process it started (stages/processes/placement.py),
    which trained the LoRA: the grid, metrics and report are byte for byte those of an evaluation
    in the command's own process (the same number of CPU threads). What it prints goes to the
    terminal without the library notes that tell a user nothing (stages/processes/library_notes.py)."""
    from lorapipe.stages.processes.cpu_threads import threads_per_process
    from lorapipe.stages.evaluate import EvalOptions, where
    from lorapipe.stages.processes.placement import WarmProcess, place

    first, params, info = evaluated
    with WarmProcess(threads_per_process(None), env=LIBRARY_WARNINGS_SHOWN) as warm:
        built = _evaluate(params, tiny_model, lora_dir, encoded, tmp_path / "ahead",
                          placement=place(where(EvalOptions()), warm))
        assert warm.alive()  # it stays for a next job, until the command ends it
    printed = (tmp_path / "ahead-work" / "logs" / "evaluate.log").read_text()
    assert "evaluate: base model" in printed  # it ran there
    assert "No LoRA keys" not in printed and "requires torchvision" not in printed
    assert built.info == info
    for name in DATA_FILES:
        assert (tmp_path / "ahead" / name).read_bytes() == (first / name).read_bytes(), name


@pytest.mark.slow
def test_encode_and_evaluate_in_the_process_started_ahead_run_on_the_threads_omp_num_threads_says(
        tmp_path, tiny_model, lora_dir, encoded, monkeypatch, capsys):
    """OMP_NUM_THREADS in the run's environment sets the torch threads of encode's and evaluate's
    jobs in the warm process, whose own count is training's (stages/processes/cpu_threads.py), not every
    core: on a busy machine threads beyond the free cores made evaluate many times slower."""
    from conftest import _encode_demo_images
    from lorapipe.stages import encode, evaluate, train
    from lorapipe.stages.processes.placement import WarmProcess, place

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with WarmProcess(2, train.unused_libraries(train.TrainParams())) as warm:  # as train.cpu_threads: 2 starts it
        _encode_demo_images(tmp_path / "cache", tiny_model, encode.EncodeParams(),
                            placement=place(encode.where(encode.EncodeOptions()), warm))
        _evaluate(EvalParams(**FAST, clip_model=str(tmp_path / "no-such-clip")), tiny_model, lora_dir, encoded,
                  tmp_path / "ahead", placement=place(evaluate.where(evaluate.EvalOptions()), warm))
    said = capsys.readouterr().out  # encode's log: print
    assert "encode: in the process started ahead\nencode: process 0 of 1: 8 latents, 9 text embeddings," \
           " 1 torch threads\n" in said, said
    rendered = re.search(r"evaluate: .* renders .*, (\d+) torch threads",
                         (tmp_path / "ahead-work" / "logs" / "evaluate.log").read_text())
    assert rendered and rendered[1] == "1"


def test_writes_grid_metrics_and_report(evaluated):
    out, params, info = evaluated
    rows, columns = len(params.prompts) * len(params.seeds), 1 + len(params.lora_scales)
    with Image.open(out / "grid.png") as grid:
        assert grid.size == (LABEL_WIDTH + columns * 64, HEADER_HEIGHT + rows * 64)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["n_samples"] == metrics["n_samples_in_split"] == {"train": 6, "holdout": 2}
    for split in ("holdout", "train"):
        for model in ("base", "lora"):
            loss = metrics["loss"][split][model]
            assert set(loss["by_timestep"]) == {"100", "500", "900"}
            assert math.isfinite(loss["overall"]) and loss["overall"] > 0
            assert loss["overall"] == pytest.approx(sum(loss["by_timestep"].values()) / 3)
            assert info[f"{split}_loss_{model}"] == loss["overall"]
    report = (out / "report.md").read_text()
    assert "](grid.png)" in report and "lora-digest" in report and "base-digest" in report


def test_the_loss_subset_has_a_fixed_size_and_keeps_its_members_as_the_split_grows():
    from types import SimpleNamespace

    from lorapipe.stages.evaluate.losses import loss_subset

    split = [SimpleNamespace(content_id=f"latent{i}") for i in range(1000)]
    chosen = {s.content_id for s in loss_subset(split, 64, loss_seed=0)}
    grown = {s.content_id for s in loss_subset(split + [SimpleNamespace(content_id=f"new{i}") for i in range(10)],
                                               64, 0)}
    assert len(chosen) == len(grown) == 64
    assert len(chosen & grown) >= 54  # only newcomers that hash lower displace a member
    assert loss_subset(split[:10], 64, 0) == split[:10] and loss_subset(split, None, 0) == split
    assert {s.content_id for s in loss_subset(split, 64, loss_seed=1)} != chosen


def test_rerun_gives_identical_bytes(evaluated, tiny_model, lora_dir, encoded):
    out, params, _ = evaluated
    again = out.parent / "again"
    _evaluate(params, tiny_model, lora_dir, encoded, again)
    for name in DATA_FILES:
        assert (again / name).read_bytes() == (out / name).read_bytes(), name


def test_lora_changes_loss_and_scale_zero_is_base(evaluated):
    out, params, _ = evaluated
    metrics = json.loads((out / "metrics.json").read_text())
    for split in ("holdout", "train"):
        assert metrics["loss"][split]["lora"]["overall"] != metrics["loss"][split]["base"]["overall"]
    with Image.open(out / "grid.png") as grid:
        grid = grid.convert("RGB")
        base = [cell(grid, r, 0, 64) for r in range(4)]
        scale_zero = [cell(grid, r, 1, 64) for r in range(4)]
        scale_one = [cell(grid, r, 2, 64) for r in range(4)]
    assert all(ImageChops.difference(a, b).getbbox() is None for a, b in zip(base, scale_zero))
    assert any(ImageChops.difference(a, b).getbbox() is not None for a, b in zip(base, scale_one))


def test_checkpoint_losses_for_every_retained_checkpoint(evaluated):
    out, _, _ = evaluated
    checkpoints = json.loads((out / "checkpoint_losses.json").read_text())
    metrics = json.loads((out / "metrics.json").read_text())
    assert [c["step"] for c in checkpoints["checkpoints"]] == [10, 20]
    assert checkpoints["base"] == metrics["loss"]["holdout"]["base"]["overall"]
    losses = {c["overall"] for c in checkpoints["checkpoints"]} | {checkpoints["base"]}
    assert len(losses) == 3  # each checkpoint's weights were really loaded
    with Image.open(out / "checkpoint_loss.png") as chart:
        assert chart.size == (500, 300)


def test_missing_clip_model_is_skipped_with_reason(evaluated):
    out, _, info = evaluated
    clip = json.loads((out / "metrics.json").read_text())["clip_score"]
    assert set(clip) == {"skipped"} and "no-such-clip" in clip["skipped"] and "does not exist" in clip["skipped"]
    assert "clip_score_base" not in info
    assert clip["skipped"] in (out / "report.md").read_text()


def test_empty_holdout_is_skipped_not_a_crash(tmp_path, tiny_model, lora_dir, encoded):
    index = json.loads((Path(encoded.artifact_dir) / "samples.json").read_text())
    for sample in index["samples"]:
        sample["split"] = "train"
    no_holdout = tmp_path / "encoded"
    shutil.copytree(encoded.artifact_dir, no_holdout)
    (no_holdout / "samples.json").write_text(json.dumps(index))
    encoded_all_train = type(encoded)(no_holdout, encoded.cache_root, encoded.digest)
    params = EvalParams(prompts=("a cat",), seeds=(0,), num_inference_steps=1, loss_timesteps=(500,))
    _evaluate(params, tiny_model, lora_dir, encoded_all_train, tmp_path / "out")
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["loss"]["holdout"] == {"skipped": "the holdout split is empty"}
    assert set(metrics["loss"]["train"]) == {"base", "lora"}
    checkpoints = json.loads((tmp_path / "out" / "checkpoint_losses.json").read_text())
    assert checkpoints == {"skipped": "the holdout split is empty"}
    assert not (tmp_path / "out" / "checkpoint_loss.png").exists()


@pytest.mark.parametrize("where", ["here", "in the warm process"])
def test_a_held_out_latent_damaged_in_place_stops_evaluate_naming_its_shard(where, tmp_path, tiny_model, lora_dir,
                                                                          encoded_copy, damage_in_place):
    """Raised as DamagedRecord wherever evaluate runs, so that the flow repairs the shard (flows/runner.py)."""
    from lorapipe.cache.samples import DamagedRecord
    from lorapipe.stages.encoded import EncodedData
    from lorapipe.stages.processes.placement import WarmProcess, Where, place

    data = EncodedData(encoded_copy.artifact_dir, encoded_copy.cache_root)
    latent = data.split("holdout")[0].latent
    shard = damage_in_place(data.store, latent)
    params = EvalParams(prompts=("a cat",), seeds=(0,), num_inference_steps=1, loss_timesteps=(500,))
    with WarmProcess(1, warm_up=()) if where != "here" else nullcontext() as warm:
        with pytest.raises(DamagedRecord, match=re.escape(f"{shard}: record {latent.key} does not match")):
            _evaluate(params, tiny_model, lora_dir, encoded_copy, tmp_path / "out", placement=place(Where(), warm))


def test_lora_trained_for_another_prediction_type_is_scored_against_it(tmp_path, tiny_model, lora_dir, encoded):
    v_lora = tmp_path / "train-artifact"
    shutil.copytree(lora_dir, v_lora)
    (v_lora / "train_config.json").write_text(json.dumps({"params": {"prediction_type": "v_prediction"}}))
    params = EvalParams(prompts=("a cat",), seeds=(0,), num_inference_steps=1, loss_timesteps=(500,))
    _evaluate(params, tiny_model, v_lora, encoded, tmp_path / "v")
    _evaluate(params, tiny_model, lora_dir, encoded, tmp_path / "eps")
    v, eps = (json.loads((tmp_path / name / "metrics.json").read_text()) for name in ("v", "eps"))
    assert v["prediction_type"] == {"base": "epsilon", "lora": "v_prediction"}
    assert eps["prediction_type"] == {"base": "epsilon", "lora": "epsilon"}
    assert v["loss"]["train"]["base"] == eps["loss"]["train"]["base"]
    assert v["loss"]["train"]["lora"] != eps["loss"]["train"]["lora"]
    assert "trained to predict v_prediction" in (tmp_path / "v" / "report.md").read_text()


def test_clip_score_with_a_local_clip_model(tmp_path, tiny_model, lora_dir, encoded, tiny_clip):
    params = EvalParams(prompts=("a cat",), seeds=(0, 1), lora_scales=(0.5, 1.0), num_inference_steps=1,
                        loss_timesteps=(500,), clip_model=str(tiny_clip))
    info = _evaluate(params, tiny_model, lora_dir, encoded, tmp_path / "out").info
    clip = json.loads((tmp_path / "out" / "metrics.json").read_text())["clip_score"]
    assert set(clip) == {"base", "lora"} and set(clip["lora"]) == {"0.5", "1.0"}
    for score in (clip["base"], *clip["lora"].values()):
        assert math.isfinite(score) and 0 <= score <= 100
    assert info["clip_score_base"] == clip["base"]


def test_a_folder_without_lora_weights_is_refused(tmp_path, tiny_model, encoded):
    with pytest.raises(FileNotFoundError, match="not a train artifact"):
        _evaluate(EvalParams(prompts=("a cat",)), tiny_model, tmp_path, encoded, tmp_path / "out")


def test_local_model_identity_is_a_content_digest(tmp_path, tiny_clip):
    from lorapipe.cache.digest import StatCache, path_identity

    with StatCache(tmp_path / "stat.sqlite") as stat_cache:
        assert path_identity(None, stat_cache) == "none"
        assert path_identity(str(tmp_path / "no-such-clip"), stat_cache) == "missing"
        copy = tmp_path / "copy"
        shutil.copytree(tiny_clip, copy)
        assert path_identity(str(copy), stat_cache) == path_identity(str(tiny_clip), stat_cache)
        (copy / "config.json").write_text("{}")
        assert path_identity(str(copy), stat_cache) != path_identity(str(tiny_clip), stat_cache)


def test_fid_and_kid_are_skipped_with_the_reason_when_they_cannot_run(evaluated, tmp_path, tiny_model, lora_dir,
                                                                      encoded, demo_images):
    out, params, _ = evaluated
    assert json.loads((out / "metrics.json").read_text())["fid_kid"] == {"skipped": "no fid_reference configured"}
    with_reference = params.model_copy(update={"fid_reference": str(demo_images)})
    _evaluate(with_reference, tiny_model, lora_dir, encoded, tmp_path / "out")
    skipped = json.loads((tmp_path / "out" / "metrics.json").read_text())["fid_kid"]["skipped"]
    assert "Inception weights" in skipped


@pytest.mark.parametrize("bad", [
    dict(prompts=()), dict(prompts=("  ",)), dict(resolution=60), dict(lora_scales=(1.0, 1.0)),
    dict(loss_timesteps=(-1,)), dict(scheduler="pndm"), dict(num_inference_steps=0),
])
def test_params_refuse_bad_values(bad):
    with pytest.raises(ValidationError):
        EvalParams(**{"prompts": ("a cat",), **bad})


def _inlined(markdown: str) -> list[tuple[str, Image.Image]]:
    import base64
    import io
    import re

    return [(mime, Image.open(io.BytesIO(base64.b64decode(data))))
            for mime, data in re.findall(r"!\[[^\]]*\]\(data:(image/\w+);base64,([^)]+)\)", markdown)]


def test_the_report_for_the_prefect_ui_carries_its_images_inline(evaluated):
    """The Prefect UI cannot reach files on the worker: every image of the report is inlined, as is."""
    from lorapipe.stages.evaluate.report import embed_images

    out, _, _ = evaluated
    inlined = embed_images((out / "report.md").read_text(), out)
    assert "](grid.png)" not in inlined and "](checkpoint_loss.png)" not in inlined
    images = _inlined(inlined)
    assert [mime for mime, _ in images] == ["image/png", "image/png"]
    for (_, image), name in zip(images, ("grid.png", "checkpoint_loss.png")):
        with Image.open(out / name) as original:
            assert ImageChops.difference(image.convert("RGB"), original.convert("RGB")).getbbox() is None, name
    assert "## Denoising loss" in inlined and "| holdout | lora |" in inlined


def test_an_image_too_big_to_inline_is_downscaled_and_a_missing_one_says_so(tmp_path):
    import numpy as np

    from lorapipe.stages.evaluate.report import EMBED_MAX_BYTES, EMBED_MAX_SIDE, embed_images

    noise = np.random.default_rng(0).integers(0, 256, (3000, 1200, 3), dtype=np.uint8)  # PNG cannot shrink it
    Image.fromarray(noise).save(tmp_path / "grid.png")
    inlined = embed_images("![samples](grid.png)\n\n![chart](checkpoint_loss.png)", tmp_path)
    [(mime, image)] = _inlined(inlined)
    assert max(image.size) <= EMBED_MAX_SIDE and len(inlined) < 1.4 * EMBED_MAX_BYTES
    assert image.size[0] / image.size[1] == pytest.approx(1200 / 3000, rel=0.01)
    assert "full size 1200x3000: grid.png" in inlined
    assert "*chart: checkpoint_loss.png could not be shown here (" in inlined


def test_a_lokr_with_an_ema_is_scored_and_rendered_beside_its_ema(tmp_path, tiny_model, encoded):
    """A real train artifact of a LoKr (which diffusers' loader refuses) trained with an EMA: evaluate
    scores both, renders an EMA column per scale, and scores each checkpoint."""
    from lorapipe.stages import train

    trained = tmp_path / "train"
    trained.mkdir()
    inputs = train.TrainInputs(encoded_dir=encoded.artifact_dir, cache_root=encoded.cache_root, model_path=tiny_model,
                               base_model_digest="base", encoded_digest=encoded.digest)
    train.run(train.TrainParams(adapter="lokr", rank=2, learning_rate=1e-2, batch_size=2, max_steps=4,
                                checkpoint_every=2, ema_decay=0.5), inputs, trained, tmp_path / "train-work",
              train.TrainOptions(log_with="none"), log=lambda line: None)
    params = EvalParams(**{**FAST, "prompts": ("a rocket",), "seeds": (0,)})
    info = _evaluate(params, tiny_model, trained, encoded, tmp_path / "evaluated").info
    out = tmp_path / "evaluated"
    with Image.open(out / "grid.png") as grid:
        assert grid.size == (LABEL_WIDTH + (1 + 2 * len(params.lora_scales)) * 64, HEADER_HEIGHT + 64)
    metrics = json.loads((out / "metrics.json").read_text())
    for split in ("holdout", "train"):
        losses = {model: metrics["loss"][split][model]["overall"] for model in ("base", "lora", "ema")}
        assert len(set(losses.values())) == 3, losses  # the EMA is not the trained adapter, nor the base
        assert info[f"{split}_loss_ema"] == losses["ema"]
    checkpoints = json.loads((out / "checkpoint_losses.json").read_text())["checkpoints"]
    assert [c["step"] for c in checkpoints] == [2, 4]
    assert checkpoints[-1]["overall"] == metrics["loss"]["holdout"]["lora"]["overall"]
    assert "| holdout | ema |" in (out / "report.md").read_text()
