"""Preprocess: what it accepts, what it rejects (by name, never a crash), and the split."""
from __future__ import annotations

import json
import shutil

import pytest
from PIL import Image

from cache.digest import StatCache
from stages.preprocess import DATASET_FILE, PreprocessInputs, PreprocessParams, center_crop, run


def preprocess(folder, tmp_path, **params):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    logs: list[str] = []
    with StatCache(tmp_path / "stat.sqlite") as cache:
        built = run(PreprocessParams(resolution=64, **params), PreprocessInputs(folder, cache), out, tmp_path, None,
                    logs.append)
    manifest = json.loads((out / DATASET_FILE).read_text())
    return manifest["samples"], json.loads((out / "report.json").read_text()), built, logs


@pytest.fixture
def folder(tmp_path, demo_images):
    data = tmp_path / "data"
    shutil.copytree(demo_images, data)
    return data


def test_unreadable_and_empty_images_are_reported_by_name_and_skipped(folder, tmp_path):
    (folder / "broken.jpg").write_bytes(b"not a jpeg")
    (folder / "broken.txt").write_text("a caption")
    (folder / "empty.png").write_bytes(b"")
    (folder / "empty.txt").write_text("a caption")
    samples, report, built, logs = preprocess(folder, tmp_path)
    assert len(samples) == 8 and built.info["rejected"] == 2
    assert {r["path"] for r in report["rejected"]} == {"broken.jpg", "empty.png"}
    assert any("broken.jpg" in line for line in logs)


def test_missing_caption_policies(folder, tmp_path):
    (folder / "rocket.txt").unlink()
    with pytest.raises(ValueError, match="rocket.jpg"):
        preprocess(folder, tmp_path)
    samples, report, _, _ = preprocess(folder, tmp_path, missing_caption="skip")
    assert len(samples) == 7 and report["rejected"] == [{"path": "rocket.jpg", "reason": "missing caption"}]
    samples, _, _, _ = preprocess(folder, tmp_path, missing_caption="filename")
    assert {s["caption"] for s in samples if s["id"] == "rocket"} == {"rocket"}


def test_metadata_jsonl_captions_and_nested_folders(tmp_path, demo_images):
    data = tmp_path / "data"
    (data / "photos").mkdir(parents=True)
    shutil.copy(demo_images / "coffee.jpg", data / "photos" / "coffee.jpg")
    (data / "metadata.jsonl").write_text(json.dumps({"file_name": "photos/coffee.jpg", "text": "  an  espresso "}) + "\n")
    samples, _, _, _ = preprocess(data, tmp_path)
    assert [(s["id"], s["caption"]) for s in samples] == [("photos/coffee", "an espresso")]


def test_a_folder_without_usable_images_is_one_clear_error(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.jpg").write_bytes(b"junk")
    with pytest.raises(ValueError, match="no usable image"):
        preprocess(tmp_path / "data", tmp_path)


def test_holdout_split_is_deterministic_and_ignores_folder_order(folder, tmp_path):
    first, _, _, _ = preprocess(folder, tmp_path, holdout_fraction=0.25)
    renamed = tmp_path / "elsewhere"
    shutil.move(folder, renamed)
    second, _, _, _ = preprocess(renamed, tmp_path, holdout_fraction=0.25)
    held = [s["id"] for s in first if s["split"] == "holdout"]
    assert len(held) == 2 and held == [s["id"] for s in second if s["split"] == "holdout"]


def test_center_crop_box_is_the_middle_square_of_the_resized_image(folder, tmp_path):
    assert center_crop(200, 100, 64) == ([64, 128], [32, 0, 96, 64])
    Image.new("RGB", (300, 100)).save(folder / "wide.png")
    (folder / "wide.txt").write_text("wide")
    samples, _, _, _ = preprocess(folder, tmp_path)
    wide = next(s for s in samples if s["id"] == "wide")
    assert wide["original_size"] == [100, 300] and wide["crop_box"] == [64, 0, 128, 64]
