"""What a run leaves in its output folder (flows/outputs.py): exactly its own files, never a mix of
two trainings, even when publishing is cut off."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lorapipe.flows.config import validate_config
from lorapipe.flows.outputs import ArtifactRemoved, finish_run
from lorapipe.flows.runner import StageResult

LORA = "pytorch_lora_weights.safetensors"
KOHYA = "pytorch_lora_weights_kohya.safetensors"
COMFYUI = "pytorch_lora_weights_comfyui.safetensors"
EVALUATED = ("grid.png", "metrics.json", "report.md")


def artifact(folder: Path, stage: str, training: str, names: tuple[str, ...]) -> StageResult:
    """A published artifact of `stage` holding `names`, each file's content naming `training`."""
    for name in names:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(f"{training} {name}")
    return StageResult(stage, "computed", training, "digest", str(folder), 1.0, "miss", files=str(folder))


def config(tmp_path: Path):
    return validate_config({"name": "t", "cache_dir": tmp_path / "cache", "output_dir": tmp_path / "out",
                            "model": {"path": tmp_path}, "data": {"path": tmp_path}, "train": {},
                            "evaluate": {"prompts": ["a photo"]}}, "test")


def published(out: Path) -> dict[str, str]:
    """Every file in `out` (less the run summary and publishing's hidden lock file) -> its content."""
    return {str(f.relative_to(out)): f.read_text() for f in sorted(out.rglob("*"))
            if f.is_file() and f.name != "run-summary.json" and not f.name.startswith(".")}


def lora_run(tmp_path: Path) -> list[StageResult]:
    """A LoRA training with an EMA, evaluated: every format, in out/ and out/ema/."""
    names = (LORA, KOHYA, COMFYUI)
    return [artifact(tmp_path / "lora-train", "train", "lora", names + tuple(f"ema/{n}" for n in names)),
            artifact(tmp_path / "lora-evaluate", "evaluate", "lora", EVALUATED)]


def test_a_run_leaves_exactly_its_own_files_and_names_them(tmp_path):
    """After a LoRA run with an EMA, a LoHa run without one (no kohya file) trained with --only
    train: the output folder holds the LoHa's two files and its summary, no kohya file, EMA or
    evaluation of the earlier training; the summary and the log name what was published."""
    out, cfg, logs = tmp_path / "out", config(tmp_path), []
    finish_run(out, cfg, lora_run(tmp_path), "first", logs.append, record=False)
    assert set(published(out)) == {LORA, KOHYA, COMFYUI, *EVALUATED, *(f"ema/{n}" for n in (LORA, KOHYA, COMFYUI))}
    loha = artifact(tmp_path / "loha-train", "train", "loha", (LORA, COMFYUI))
    finish_run(out, cfg, [loha], "second", logs.append, record=False)
    assert published(out) == {LORA: f"loha {LORA}", COMFYUI: f"loha {COMFYUI}"}
    assert not (out / "ema").exists()
    summary = json.loads((out / "run-summary.json").read_text())
    assert summary["run"] == "second" and summary["stages"][0]["outputs"] == [LORA, COMFYUI]
    assert logs[-1] == (f"outputs: {out}: published {LORA}, {COMFYUI} and run-summary.json; removed the previous"
                        f" run's {KOHYA}, ema/{LORA}, ema/{KOHYA}, ema/{COMFYUI}, {', '.join(EVALUATED)}")


def test_a_video_evaluation_publishes_its_clips_and_the_next_run_replaces_them(tmp_path):
    """A video model's evaluation publishes every clip under clips/ (metrics.json names them from the
    output folder) and the log counts them; a later evaluation with other columns leaves none of the
    earlier clips, and an image model's no clips/ folder."""
    out, cfg, logs = tmp_path / "out", config(tmp_path), []
    clips = tuple(f"clips/{column}/{row}.mp4" for column in ("00-base", "01-lora-x1")
                  for row in ("00-seed0", "01-seed1"))
    video = artifact(tmp_path / "video", "evaluate", "video", (*EVALUATED, "grid.webp", *clips))
    finish_run(out, cfg, [video], "first", logs.append, record=False)
    assert set(published(out)) == {*EVALUATED, "grid.webp", *clips}
    assert logs[-1] == (f"outputs: {out}: published grid.png, grid.webp, 4 clips in clips/, metrics.json, report.md"
                        " and run-summary.json")
    other = (clips[0], "clips/02-ema-x1/00-seed0.mp4")
    finish_run(out, cfg, [artifact(tmp_path / "other", "evaluate", "other", (*EVALUATED, "grid.webp", *other))],
               "second", logs.append, record=False)
    assert published(out) == {name: f"other {name}" for name in (*EVALUATED, "grid.webp", *other)}
    assert not (out / "clips" / "01-lora-x1").exists()
    assert logs[-1].endswith("; removed the previous run's 3 clips in clips/")
    finish_run(out, cfg, [artifact(tmp_path / "image", "evaluate", "image", EVALUATED)], "third", print, record=False)
    assert set(published(out)) == set(EVALUATED) and not (out / "clips").exists()


def test_a_publish_cut_off_never_leaves_files_of_two_trainings(tmp_path, monkeypatch):
    """An artifact removed while its files are copied: the previous run's files and summary stay
    as they were. A publish that dies between two renames: only the new run's files, and no
    run-summary.json (a reader can tell); the next run publishes whole."""
    out, cfg = tmp_path / "out", config(tmp_path)
    finish_run(out, cfg, lora_run(tmp_path), "first", print, record=False)
    before = (published(out), (out / "run-summary.json").read_text())
    loha = artifact(tmp_path / "loha-train", "train", "loha", (LORA, COMFYUI))
    gone = StageResult("evaluate", "hit", "k", "digest", str(tmp_path / "removed"), 0.0, "hit",
                       files=str(tmp_path / "removed"))
    with pytest.raises(ArtifactRemoved):
        finish_run(out, cfg, [loha, gone], "second", print, record=False)
    assert (published(out), (out / "run-summary.json").read_text()) == before

    replace, renames = os.replace, []

    def dies_on_the_second_rename(src, dst):
        renames.append(dst)
        if len(renames) == 2:
            raise OSError("the machine went down")
        replace(src, dst)

    monkeypatch.setattr(os, "replace", dies_on_the_second_rename)
    with pytest.raises(OSError, match="went down"):
        finish_run(out, cfg, [loha], "second", print, record=False)
    monkeypatch.undo()
    assert published(out) == {LORA: f"loha {LORA}"} and not (out / "run-summary.json").exists()
    finish_run(out, cfg, [loha], "second", print, record=False)
    assert published(out) == {LORA: f"loha {LORA}", COMFYUI: f"loha {COMFYUI}"}
    assert [p.name for p in out.iterdir() if p.name.startswith(".") and not p.name.endswith(".lock")] == []


def test_the_terminal_summary_names_where_the_lora_grid_and_metrics_went(tmp_path, capsys):
    """`lorapipe run` ends by naming the published LoRA, sample grid, metrics and run summary (the
    files the stages label in their OUTPUT_FILES), and only those the run published."""
    from lorapipe.flows.commands import print_summary

    out, cfg = tmp_path / "out", config(tmp_path)
    summary = finish_run(out, cfg, lora_run(tmp_path), "first", print, record=False)
    capsys.readouterr()
    print_summary(cfg, summary, tmp_path / "run.log", as_json=False)
    named = [line.split(maxsplit=1) for line in capsys.readouterr().out.splitlines()[-5:]]
    assert named == [["LoRA:", str(out / LORA)], ["sample", f"grid: {out / 'grid.png'}"],
                     ["metrics:", str(out / "metrics.json")], ["run", f"summary: {out / 'run-summary.json'}"],
                     ["run", f"log:     {tmp_path / 'run.log'}"]]
    loha = artifact(tmp_path / "loha-train", "train", "loha", (LORA, COMFYUI))
    summary = finish_run(out, cfg, [loha], "second", print, record=False)
    capsys.readouterr()
    print_summary(cfg, summary, tmp_path / "run.log", as_json=False)
    assert "grid" not in capsys.readouterr().out  # not published by this run: not named


def test_the_summaries_name_the_components_set_over_the_base(tmp_path, capsys):
    """run-summary.json, `run --json` and the printed summary say which files were set over the base
    (model.transformer, model.text_encoders, ...), as the config named them."""
    from lorapipe.flows.commands import print_summary

    transformer, clip, t5 = (tmp_path / f"{name}.safetensors" for name in ("finetune", "clip_l", "t5xxl"))
    cfg = validate_config({"name": "t", "cache_dir": tmp_path / "cache", "output_dir": tmp_path / "out",
                           "model": {"path": tmp_path, "transformer": transformer, "text_encoders": [clip, t5]},
                           "data": {"path": tmp_path}, "train": {}, "evaluate": {"prompts": ["a photo"]}}, "test")
    expected = {"model.transformer": str(transformer), "model.text_encoders[0]": str(clip),
                "model.text_encoders[1]": str(t5)}
    summary = finish_run(tmp_path / "out", cfg, lora_run(tmp_path), "first", print, record=False)
    assert json.loads((tmp_path / "out" / "run-summary.json").read_text())["components"] == expected
    capsys.readouterr()
    print_summary(cfg, summary, tmp_path / "run.log", as_json=True)
    assert json.loads(capsys.readouterr().out)["components"] == expected
    print_summary(cfg, summary, tmp_path / "run.log", as_json=False)
    printed = capsys.readouterr().out
    assert all(f"{key}: " in printed and path in printed for key, path in expected.items())
