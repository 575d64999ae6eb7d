"""Preprocess: what it accepts, what it rejects (by name and reason, never a crash), crops,
buckets, several datasets with repeats, and the split."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil

import pytest
from PIL import Image

from cache.digest import StatCache
from flows.config import ConfigError, validate_config
from stages.preprocess import (DATASET_FILE, DatasetSource, PreprocessInputs, PreprocessParams, dataset_ingredients,
                               run)
from stages.preprocess.crops import generated_buckets, place


def preprocess(datasets, tmp_path, **params):
    datasets = tuple(d if isinstance(d, DatasetSource) else DatasetSource(path=d)
                     for d in (datasets if isinstance(datasets, (list, tuple)) else [datasets]))
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    logs: list[str] = []
    with StatCache(tmp_path / "stat.sqlite") as cache:
        built = run(PreprocessParams(**{"resolution": 64, **params}), PreprocessInputs(datasets, cache), out,
                    tmp_path, None, logs.append)
    manifest = json.loads((out / DATASET_FILE).read_text())
    return manifest["samples"], json.loads((out / "report.json").read_text()), built, logs


def image(path, size=(96, 64), mode="RGB", caption="a caption", color=(200, 30, 30), **save):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, color).save(path, **save)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption)
    return path


@pytest.fixture
def folder(tmp_path, demo_images):
    data = tmp_path / "data"
    shutil.copytree(demo_images, data)
    return data


def test_every_kind_of_bad_image_is_reported_by_reason_and_name(folder, tmp_path):
    (folder / "broken.jpg").write_bytes(b"not a jpeg")
    (folder / "empty.png").write_bytes(b"")
    jpeg = (folder / "coffee.jpg").read_bytes()
    (folder / "cut.jpg").write_bytes(jpeg[: len(jpeg) // 2])
    shutil.copy(folder / "coffee.jpg", folder / "zz-copy.jpg")
    shutil.copy(folder / "rocket.jpg", folder / "rocket.png")  # same name, same bytes as rocket.jpg
    image(folder / "tiny.png", size=(20, 20))
    (folder / "gone.jpg").symlink_to(folder / "nowhere.jpg")
    for name in ("broken", "empty", "cut", "zz-copy", "gone"):
        (folder / f"{name}.txt").write_text("a caption")
    samples, report, built, logs = preprocess(folder, tmp_path, min_side=32)
    reasons = {r["path"]: r["reason"] for r in report["rejected"]}
    assert reasons == {"broken.jpg": "not_an_image", "empty.png": "empty_file", "cut.jpg": "truncated",
                       "zz-copy.jpg": "duplicate", "rocket.png": "duplicate", "tiny.png": "too_small",
                       "gone.jpg": "unreadable"}
    assert len(samples) == 8 and built.info["rejected"] == 7 and report["counts"]["duplicate"] == 2
    assert next(r for r in report["rejected"] if r["path"] == "zz-copy.jpg")["detail"] == "same bytes as coffee.jpg"
    assert "preprocess: rejected 2 duplicate: rocket.png, zz-copy.jpg" in logs


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their permissions")
def test_a_file_without_read_permission_is_reported(folder, tmp_path):
    (folder / "coffee.jpg").chmod(0)
    _, report, _, _ = preprocess(folder, tmp_path)
    assert report["rejected"][0]["path"] == "coffee.jpg" and report["rejected"][0]["reason"] == "unreadable"


def test_missing_and_empty_caption_policies(folder, tmp_path):
    (folder / "rocket.txt").unlink()
    (folder / "camera.txt").write_text("  \n")
    with pytest.raises(ValueError, match=r"camera.jpg: no caption \(.*\(and 1 more\)") as err:
        preprocess(folder, tmp_path)
    assert "\n" not in str(err.value)
    samples, report, _, _ = preprocess(folder, tmp_path, missing_caption="skip")
    assert len(samples) == 6 and {(r["path"], r["reason"]) for r in report["rejected"]} == {
        ("rocket.jpg", "missing_caption"), ("camera.jpg", "missing_caption")}
    samples, _, _, _ = preprocess(folder, tmp_path, missing_caption="filename")
    assert {s["id"]: s["caption"] for s in samples}["rocket"] == "rocket"


def test_metadata_jsonl_and_csv_captions_in_nested_folders(tmp_path, demo_images):
    data = tmp_path / "data"
    (data / "photos" / "more").mkdir(parents=True)
    shutil.copy(demo_images / "coffee.jpg", data / "photos" / "coffee.jpg")
    shutil.copy(demo_images / "rocket.jpg", data / "photos" / "more" / "rocket.jpg")
    (data / "metadata.jsonl").write_text(json.dumps({"file_name": "photos/coffee.jpg", "text": "  an  espresso "}))
    (data / "photos" / "more" / "metadata.csv").write_text('file_name,prompt\nrocket.jpg,"a rocket, at night"\n')
    with pytest.raises(ValueError, match="metadata.jsonl:1: needs the columns file_name and prompt"):
        preprocess(DatasetSource(path=data, caption_column="prompt"), tmp_path)
    (data / "metadata.jsonl").write_text(json.dumps({"file_name": "photos/coffee.jpg", "prompt": "an espresso"}))
    samples, _, _, _ = preprocess(DatasetSource(path=data, caption_column="prompt"), tmp_path)
    assert [(s["id"], s["caption"]) for s in samples] == [("photos/coffee", "an espresso"),
                                                          ("photos/more/rocket", "a rocket, at night")]


def test_several_datasets_with_their_own_captions_and_repeats(tmp_path):
    image(tmp_path / "cats" / "a.png", caption=None)
    (tmp_path / "cats" / "a.caption").write_text("a cat")
    image(tmp_path / "dogs" / "a.png", color=(0, 0, 250), caption="a dog")
    image(tmp_path / "dogs" / "same.png", caption=None)  # the cat's bytes again
    datasets = [DatasetSource(path=tmp_path / "cats", caption_ext=".caption", repeats=10),
                DatasetSource(path=tmp_path / "dogs", name="pups")]
    samples, report, _, _ = preprocess(datasets, tmp_path, missing_caption="empty")
    assert [(s["id"], s["source"], s["path"], s["caption"], s["repeats"]) for s in samples] == [
        ("cats/a", 0, "a.png", "a cat", 10), ("pups/a", 1, "a.png", "a dog", 1)]
    assert report["rejected"] == [{"path": "pups/same.png", "reason": "duplicate", "detail": "same bytes as cats/a.png"}]


def test_the_key_holds_each_datasets_settings_and_contents_but_not_its_location(tmp_path):
    image(tmp_path / "one" / "a.png")
    with StatCache(tmp_path / "stat.sqlite") as cache:
        key = lambda d, **p: dataset_ingredients(d, PreprocessParams(**p), cache)  # noqa: E731
        first = key((DatasetSource(path=tmp_path / "one"),))
        shutil.copytree(tmp_path / "one", tmp_path / "two")
        assert key((DatasetSource(path=tmp_path / "two"),)) == first
        assert key((DatasetSource(path=tmp_path / "two", repeats=3),)) != first
        (tmp_path / "two" / "a.txt").write_text("another caption")
        assert key((DatasetSource(path=tmp_path / "two"),)) != first
        (tmp_path / "two" / "notes.md").write_text("not part of the dataset")
        assert key((DatasetSource(path=tmp_path / "two"),)) == key((DatasetSource(path=tmp_path / "two"),))


def test_a_folder_without_usable_images_is_one_clear_error(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.jpg").write_bytes(b"junk")
    with pytest.raises(ValueError, match=r"no usable image in .*data \(1 not_an_image\)"):
        preprocess(tmp_path / "data", tmp_path)


def test_holdout_split_is_deterministic_and_ignores_folder_order(folder, tmp_path):
    first, _, _, _ = preprocess(folder, tmp_path, holdout_fraction=0.25)
    renamed = tmp_path / "elsewhere"
    shutil.move(folder, renamed)
    second, _, _, _ = preprocess(renamed, tmp_path, holdout_fraction=0.25)
    held = [s["id"] for s in first if s["split"] == "holdout"]
    assert len(held) == 2 and held == [s["id"] for s in second if s["split"] == "holdout"]


def test_center_and_random_crops(tmp_path):
    assert place(200, 100, (64, 64), False, 0, "x") == ([64, 128], [32, 0, 96, 64])
    image(tmp_path / "data" / "wide.png", size=(300, 100))
    image(tmp_path / "data" / "tall.png", size=(100, 300), color=(1, 2, 3))
    samples, _, _, _ = preprocess(tmp_path / "data", tmp_path)
    assert samples[1]["original_size"] == [100, 300] and samples[1]["crop_box"] == [64, 0, 128, 64]
    boxes = [s["crop_box"] for s in preprocess(tmp_path / "data", tmp_path, crop="random", seed=1)[0]]
    assert boxes == [s["crop_box"] for s in preprocess(tmp_path / "data", tmp_path, crop="random", seed=1)[0]]
    assert boxes != [s["crop_box"] for s in preprocess(tmp_path / "data", tmp_path, crop="random", seed=2)[0]]
    assert all(b[2] - b[0] == b[3] - b[1] == 64 and min(b) >= 0 and max(b) <= 192 for b in boxes)


def test_buckets_exif_orientation_and_never_upscale(tmp_path):
    assert generated_buckets(512, 2.0) == [(384, 640), (448, 576), (512, 512), (576, 448), (640, 384)]
    data = tmp_path / "data"
    image(data / "wide.png", size=(400, 200))
    exif = Image.Exif()
    exif[0x0112] = 6  # stored landscape, shown portrait
    image(data / "turned.jpg", size=(400, 240), color=(9, 9, 9), exif=exif.tobytes())
    image(data / "small.png", size=(150, 150), color=(5, 50, 5))
    samples = {s["id"]: s for s in preprocess(data, tmp_path, resolution=256, buckets=True)[0]}
    assert samples["wide"]["size"] == [192, 320] and samples["wide"]["crop_box"] == [32, 0, 352, 192]
    assert samples["turned"]["original_size"] == [400, 240] and samples["turned"]["size"] == [320, 192]
    assert samples["small"]["size"] == [256, 256] and samples["small"]["resized"] == [256, 256]
    kept = {s["id"]: s for s in preprocess(data, tmp_path, resolution=256, buckets=True, never_upscale=True)[0]}
    assert kept["small"]["size"] == [128, 128] and kept["wide"]["size"] == [192, 320]
    explicit = preprocess(data, tmp_path, resolution=256, buckets=True, bucket_sizes=[[128, 64], [64, 64]])[0]
    assert {s["id"]: s["size"] for s in explicit} == {"small": [64, 64], "turned": [64, 64], "wide": [64, 128]}


def test_alpha_images_record_the_background(tmp_path):
    image(tmp_path / "data" / "clear.png", mode="RGBA", color=(0, 0, 0, 0))
    image(tmp_path / "data" / "solid.png")
    samples = preprocess(tmp_path / "data", tmp_path, background=[0, 0, 255])[0]
    assert [s.get("background") for s in samples] == [[0, 0, 255], None]


def test_hf_and_parquet_formats_without_the_datasets_package_are_one_clear_error(tmp_path):
    if importlib.util.find_spec("datasets"):
        pytest.skip("datasets is installed")
    (tmp_path / "saved").mkdir()
    with pytest.raises(ValueError, match="saved: format hf needs the `datasets` package"):
        preprocess(DatasetSource(path=tmp_path / "saved", format="hf"), tmp_path)


def base_config(tmp_path, data):
    return {"cache_dir": tmp_path, "output_dir": tmp_path, "model": {"path": tmp_path}, "data": data,
            "train": {}, "evaluate": {"prompts": ["x"]}}


def test_the_data_section_takes_one_path_or_a_list_of_datasets(tmp_path):
    config = validate_config(base_config(tmp_path, {"path": tmp_path / "a"}), "c.yaml")
    assert config.data.sources == (DatasetSource(path=tmp_path / "a"),)
    listed = validate_config(base_config(tmp_path, {"datasets": [{"path": tmp_path / "a", "repeats": 5},
                                                                 {"path": tmp_path / "b"}]}), "c.yaml")
    assert [d.repeats for d in listed.data.sources] == [5, 1]
    for data, message in (({}, "either data.path or data.datasets"),
                          ({"datasets": [{"path": tmp_path / "a"}, {"path": tmp_path / "x" / "a"}]}, "named 'a'"),
                          ({"datasets": [{"path": tmp_path, "repeats": 0}]}, "data.datasets.0.repeats")):
        with pytest.raises(ConfigError, match=message):
            validate_config(base_config(tmp_path, data), "c.yaml")


def test_a_dataset_can_be_the_validation_set(tmp_path):
    for i in range(4):
        image(tmp_path / "train" / f"t{i}.png", color=(i, 0, 0))
        image(tmp_path / "val" / f"v{i}.png", color=(0, 100 + i, 0))  # no byte duplicates
    datasets = [DatasetSource(path=tmp_path / "train"), DatasetSource(path=tmp_path / "val", split="holdout")]
    samples, _, built, _ = preprocess(datasets, tmp_path, holdout_fraction=0.25)
    validation = {f"val/v{i}" for i in range(4)}
    held = {s["id"] for s in samples if s["split"] == "holdout"}
    assert validation < held and len(held - validation) == 1  # the fraction applies to "auto" datasets
    assert built.info["holdout"] == 5
    samples, _, _, _ = preprocess(datasets, tmp_path, holdout_fraction=0)
    assert {s["id"] for s in samples if s["split"] == "holdout"} == validation
