"""Preprocess: what it accepts, what it rejects (by name and reason, never a crash), crops,
buckets, several datasets with repeats, and the split."""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from blake3 import blake3
from PIL import Image

from lorapipe.cache.digest import StatCache
from lorapipe.flows.config import ConfigError, validate_config
from lorapipe.flows.runner import StageResult
from lorapipe.stages.encode import ImageCrops
from lorapipe.stages.preprocess import (DATASET_FILE, DatasetSource, PreprocessInputs, PreprocessParams, dataset_ingredients,
                               run)
from lorapipe.stages.preprocess.crops import generated_buckets, place
from lorapipe.stages.preprocess.rows import SampleRow
from lorapipe.stages.preprocess.sources import read_image_bytes
from permissions import as_a_plain_user
from published import EVALUATION, published_report

TESTS = Path(__file__).resolve().parent


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
    out = str(tmp_path / "out")
    report_md = published_report(tmp_path, [StageResult("preprocess", "computed", "key", "digest", out, 1.0, "miss",
                                                        files=out)])
    assert report_md.startswith(f"{EVALUATION}\n## Dataset\n\nRejected: 7\n")  # the user's report lists them
    assert "- `gone.jpg`: unreadable (cannot read the file (No such file or directory))\n" in report_md
    assert "- `tiny.png`: too_small (20x20 is below preprocess.min_side 32)\n" in report_md
    assert report_md.endswith("Warnings: none\n")


def test_a_file_without_read_permission_is_reported(folder, tmp_path):
    """In a child process without root's right to read any file, so that it holds under root too."""
    (folder / "coffee.jpg").chmod(0)
    code = ("import json, sys, pathlib; sys.path.insert(0, sys.argv[1]); from test_preprocess import preprocess;"
            " print(json.dumps(preprocess(pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3]))[1]['rejected']))")
    child = subprocess.run([sys.executable, "-c", code, str(TESTS), str(folder), str(tmp_path)], capture_output=True,
                           text=True, check=True, preexec_fn=as_a_plain_user())
    rejected = json.loads(child.stdout.splitlines()[-1])
    assert [(r["path"], r["reason"]) for r in rejected] == [("coffee.jpg", "unreadable")]


def test_missing_and_empty_caption_policies(folder, tmp_path):
    (folder / "rocket.txt").unlink()
    (folder / "camera.txt").write_text("  \n")
    with pytest.raises(ValueError, match=r"camera.jpg: no caption \(camera.txt is empty\) \(and 1 more\)") as err:
        preprocess(folder, tmp_path)
    assert "\n" not in str(err.value)
    (folder / "camera.txt").write_text("a camera")
    with pytest.raises(ValueError, match=r"rocket.jpg: no caption \(looked for rocket.txt, rocket.caption and a row"
                                         r" naming it in a metadata.jsonl or metadata.csv\);"):
        preprocess(folder, tmp_path)
    (folder / "camera.txt").write_text("  \n")
    samples, report, _, _ = preprocess(folder, tmp_path, missing_caption="skip")
    assert len(samples) == 6 and {(r["path"], r["reason"]) for r in report["rejected"]} == {
        ("rocket.jpg", "missing_caption"), ("camera.jpg", "missing_caption")}
    assert {r["path"]: r["detail"] for r in report["rejected"]}["camera.jpg"] == "camera.txt is empty"
    samples, _, _, _ = preprocess(folder, tmp_path, missing_caption="filename")
    assert {s["id"]: s["caption"] for s in samples}["rocket"] == "rocket"


def test_metadata_jsonl_and_csv_captions_in_nested_folders(tmp_path, demo_images):
    data = tmp_path / "data"
    (data / "photos" / "more").mkdir(parents=True)
    shutil.copy(demo_images / "coffee.jpg", data / "photos" / "coffee.jpg")
    shutil.copy(demo_images / "rocket.jpg", data / "photos" / "more" / "rocket.jpg")
    (data / "metadata.jsonl").write_text(json.dumps({"file_name": "photos/coffee.jpg", "text": "  an  espresso "}))
    (data / "photos" / "more" / "metadata.csv").write_text('file_name,prompt\nrocket.jpg,"a rocket, at night"\n')
    with pytest.raises(ValueError, match=r"coffee.jpg: no caption \(metadata.jsonl:1 has no 'prompt' value"):
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


@pytest.mark.parametrize("role", ["prior", "train"])
def test_one_of_several_datasets_without_a_usable_image_is_named(tmp_path, role):
    """It was left out silently (a prior dataset regularised nothing), while one empty dataset alone
    is refused."""
    image(tmp_path / "subject" / "a.png")
    image(tmp_path / "class" / "b.png", caption=None)
    (tmp_path / "class" / "c.txt").write_text("a caption without its image")
    datasets = [DatasetSource(path=tmp_path / "subject"), DatasetSource(path=tmp_path / "class", role=role)]
    role_note = r" \(role: prior\)" if role == "prior" else ""
    with pytest.raises(ValueError, match=rf"^no usable image in dataset 'class'{role_note}, .*/class \(1"
                                         r" missing_caption\): fix its path"):
        preprocess(datasets, tmp_path, missing_caption="skip")


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


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")


def test_png_orientation_is_read_without_decoding_pixels_and_damage_is_named_at_decode(tmp_path):
    """A PNG's EXIF orientation is honoured before and after its pixel data (eXIf after IDAT:
    what Pillow's getexif() decodes the image to reach); a PNG whose pixel data is damaged passes
    preprocess, which reads no pixels, and encode names it and why; a broken header is refused."""
    data = tmp_path / "data"
    exif = Image.Exif()
    exif[0x0112] = 6  # stored landscape, shown portrait
    image(data / "before.png", size=(96, 64), exif=exif)
    png = image(data / "after.png", size=(96, 64), color=(0, 90, 0)).read_bytes()
    end = png.index(b"IEND") - 4
    (data / "after.png").write_bytes(png[:end] + png_chunk(b"eXIf", exif.tobytes()) + png[end:])
    noisy = image(data / "damaged.png", size=(256, 256), color=(1, 2, 3))
    Image.effect_noise((256, 256), 60).convert("RGB").save(noisy)
    damaged = bytearray(noisy.read_bytes())
    start = damaged.index(b"IDAT") + 200
    damaged[start:start + 200] = bytes(b ^ 0x55 for b in damaged[start:start + 200])
    noisy.write_bytes(bytes(damaged))
    header = bytearray(png)
    header[16:20] = (9999).to_bytes(4, "big")  # IHDR's width, its CRC left as it was
    image(data / "broken-header.png").write_bytes(bytes(header))
    samples, report, _, _ = preprocess(data, tmp_path, holdout_fraction=0)
    by_path = {s["path"]: s for s in samples}
    assert by_path["before.png"]["original_size"] == by_path["after.png"]["original_size"] == [96, 64]
    assert [(r["path"], r["reason"]) for r in report["rejected"]] == [("broken-header.png", "not_an_image")]
    _, pixels, why = ImageCrops((DatasetSource(path=data),), [SampleRow.model_validate(by_path["damaged.png"])], [False])[0]
    assert pixels is None and why.startswith("cannot decode its pixels: the image data is damaged"), why


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
                          ({"datasets": [{"path": tmp_path, "repeats": 0}]}, "data.datasets.0.repeats"),
                          ({"datasets": [{"path": tmp_path / "a", "role": "prior"}]},
                           "data.datasets: .*every dataset has role: prior, so there is nothing to learn")):
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


# --- Data safety: nothing outside a dataset is read; metadata rows; caption sidecars; small images

def blake3_hex(path):
    return blake3(path.read_bytes()).hexdigest()


def appears_under(root, text: str) -> list[str]:
    """Every file under `root` (manifests, reports, the stat cache's database) holding `text`."""
    return [str(p) for p in root.rglob("*") if p.is_file() and text.encode() in p.read_bytes()]


@pytest.fixture
def outside(tmp_path):
    """Images and a caption next to the dataset, not in it, each with bytes seen nowhere else."""
    image(tmp_path / "outside" / "secret.png", color=(1, 2, 3), caption=None)
    image(tmp_path / "outside" / "folder" / "inner.png", color=(4, 5, 6))
    (tmp_path / "outside" / "secret.txt").write_text("a caption kept outside")
    return tmp_path / "outside"


def test_links_and_metadata_rows_leading_outside_the_dataset_are_refused_and_never_read(tmp_path, outside):
    data = tmp_path / "data"
    image(data / "a.png")
    image(data / ".store" / "kept.png", color=(0, 90, 0), caption=None)  # git-annex style: a link inside
    (data / "alias.png").symlink_to(data / ".store" / "kept.png")
    (data / "alias.txt").write_text("a link inside the dataset")
    (data / "secret.png").symlink_to(outside / "secret.png")
    (data / "secret.txt").write_text("a link leading outside")
    (data / "folder").symlink_to(outside / "folder")
    image(data / "captioned.png", color=(0, 0, 90), caption=None)
    (data / "captioned.txt").symlink_to(outside / "secret.txt")
    (data / "metadata.jsonl").write_text("\n".join(json.dumps({"file_name": name, "text": "x"}) for name in (
        "../outside/secret.png", str(outside / "secret.png"), "folder/inner.png")))
    cache_dir = tmp_path / "cache"
    with StatCache(cache_dir / "stat.sqlite") as cache:  # the key computation
        dataset_ingredients((DatasetSource(path=data),), PreprocessParams(), cache)
    samples, report, _, _ = preprocess(data, cache_dir)
    assert [s["id"] for s in samples] == ["a", "alias"]
    assert {(r["path"], r["reason"]) for r in report["rejected"]} == {
        ("secret.png", "outside_dataset"), ("folder", "outside_dataset"), ("captioned.png", "outside_dataset"),
        ("metadata.jsonl:1", "outside_dataset"), ("metadata.jsonl:2", "outside_dataset"),
        ("metadata.jsonl:3", "outside_dataset")}
    assert "follow_symlinks" in next(r["detail"] for r in report["rejected"] if r["path"] == "secret.png")
    assert appears_under(cache_dir, blake3_hex(data / "a.png"))  # what was hashed can be found
    for secret in (outside / "secret.png", outside / "folder" / "inner.png", outside / "secret.txt"):
        assert not appears_under(cache_dir, blake3_hex(secret))
    assert not appears_under(cache_dir, "kept outside")
    assert not [r for r in report["rejected"] if str(outside) in r["detail"] and ":" not in r["path"]]


def test_follow_symlinks_opts_in_to_links_leading_outside(tmp_path, outside):
    data = tmp_path / "data"
    image(data / "a.png")
    (data / "secret.png").symlink_to(outside / "secret.png")
    (data / "secret.txt").write_text("a linked image")
    (data / "folder").symlink_to(outside / "folder")
    followed = DatasetSource(path=data, follow_symlinks=True)
    samples, report, _, _ = preprocess(followed, tmp_path)
    assert [s["id"] for s in samples] == ["a", "folder/inner", "secret"] and report["rejected"] == []
    assert samples[2]["digest"] == blake3_hex(outside / "secret.png")
    with StatCache(tmp_path / "stat.sqlite") as cache:
        keys = [dataset_ingredients((d,), PreprocessParams(), cache) for d in (followed, DatasetSource(path=data))]
    assert keys[0] != keys[1]


def test_symlink_loops_are_reported_once_never_walked(tmp_path):
    data = tmp_path / "data"
    image(data / "a" / "img.png")
    (data / "a" / "back").symlink_to("..")
    (data / "b").mkdir()
    (data / "c").mkdir()
    (data / "b" / "to_c").symlink_to(data / "c")
    (data / "c" / "to_b").symlink_to(data / "b")
    samples, report, _, _ = preprocess(data, tmp_path)
    assert [s["id"] for s in samples] == ["a/img"]
    assert [(r["path"], r["reason"]) for r in report["rejected"]] == [
        ("a/back", "symlink_loop"), ("b/to_c/to_b", "symlink_loop"), ("c/to_b/to_c", "symlink_loop")]


def test_a_file_replaced_by_a_link_to_outside_after_preprocess_is_not_read(tmp_path, outside):
    data = tmp_path / "data"
    image(data / "a.png")
    samples, _, _, _ = preprocess(data, tmp_path)
    (data / "a.png").unlink()
    (data / "a.png").symlink_to(outside / "secret.png")
    with pytest.raises(OSError, match="a.png now leads outside the dataset folder"):
        read_image_bytes(DatasetSource(path=data), samples[0]["path"])
    assert read_image_bytes(DatasetSource(path=data, follow_symlinks=True), "a.png") == (outside / "secret.png").read_bytes()


def rows_dataset(data):
    """Four images; metadata rows with every kind of problem beside good ones."""
    for i, name in enumerate(("a", "b", "c", "sub/d")):
        image(data / f"{name}.png", color=(i, 50, 50), caption=None)
    (data / "c.txt").write_text("c from its sidecar")
    lines = [json.dumps({"file_name": "a.png", "text": "first a"}),
             json.dumps({"file_name": "gone.png", "text": "no such file"}),
             json.dumps({"file_name": "a.png", "text": "second a"}),
             '{"file_name": "b.png", "text": ',
             json.dumps({"text": "a row without a file name"}),
             json.dumps(["not", "an", "object"]),
             "",
             json.dumps({"file_name": "b.png", "text": "a b"})]
    (data / "metadata.jsonl").write_bytes("\n".join(lines).encode() + b'\n{"file_name": "c.png", "text": "\xff"}\n')
    (data / "sub" / "metadata.csv").write_text('file_name,text\nd.png,"a d"\n,no name\n../a.png,"a again"\n')


def test_metadata_row_problems_are_reported_by_line_and_the_rest_of_the_dataset_is_used(tmp_path):
    rows_dataset(tmp_path / "data")
    samples, report, built, logs = preprocess(tmp_path / "data", tmp_path)
    assert {s["id"]: s["caption"] for s in samples} == {
        "a": "first a", "b": "a b", "c": "c from its sidecar", "sub/d": "a d"}
    assert [(r["path"], r["reason"]) for r in report["rejected"]] == [
        ("metadata.jsonl:2", "listed_but_missing"), ("metadata.jsonl:3", "duplicate_row"),
        ("metadata.jsonl:4", "bad_row"), ("metadata.jsonl:5", "bad_row"), ("metadata.jsonl:6", "bad_row"),
        ("metadata.jsonl:9", "bad_row"), ("sub/metadata.csv:3", "bad_row"), ("sub/metadata.csv:4", "duplicate_row")]
    details = {r["path"]: r["detail"] for r in report["rejected"]}
    assert details["metadata.jsonl:3"] == "a.png is listed again: the row at metadata.jsonl:1 is used"
    assert details["sub/metadata.csv:4"] == "a.png is listed again: the row at metadata.jsonl:1 is used"
    assert "'gone.png'" in details["metadata.jsonl:2"] and details["metadata.jsonl:9"] == "not UTF-8 text"
    assert built.info["rejected_by_reason"] == {"bad_row": 5, "duplicate_row": 2, "listed_but_missing": 1}
    assert "preprocess: rejected 5 bad_row: metadata.jsonl:4, metadata.jsonl:5, metadata.jsonl:6 and 2 more" in logs


def test_on_bad_row_error_stops_at_the_first_bad_row_in_one_line(tmp_path):
    data = tmp_path / "data"
    rows_dataset(data)
    with pytest.raises(ValueError, match=r"data/metadata.jsonl:2: listed_but_missing: file_name 'gone.png'.*"
                                         r"\(and 7 more\); on_bad_row is error \(or --strict\)") as err:
        preprocess(data, tmp_path, on_bad_row="error")
    assert "\n" not in str(err.value)
    assert len(preprocess(DatasetSource(path=data, on_bad_row="skip"), tmp_path, on_bad_row="error")[0]) == 4
    with pytest.raises(ValueError, match="metadata.jsonl:2"):
        preprocess(DatasetSource(path=data, on_bad_row="error"), tmp_path)
    config = validate_config(base_config(tmp_path, {"path": data}), "c.yaml")
    assert config.preprocess.on_bad_row == "skip"


def test_a_dot_caption_sidecar_is_used_where_no_txt_exists_unless_caption_ext_is_set(tmp_path):
    data = tmp_path / "data"
    image(data / "kohya.png", caption=None)
    (data / "kohya.caption").write_text("from the caption file")
    image(data / "both.png", color=(0, 0, 200))
    (data / "both.caption").write_text("not used: both.txt exists")
    samples = preprocess(data, tmp_path)[0]
    assert {s["id"]: s["caption"] for s in samples} == {"both": "a caption", "kohya": "from the caption file"}
    _, report, _, _ = preprocess(data, tmp_path, caption_ext=".txt", missing_caption="skip")
    assert [(r["path"], r["reason"], r["detail"]) for r in report["rejected"]] == [
        ("kohya.png", "missing_caption", "looked for kohya.txt and a row naming it in a metadata.jsonl or"
                                         " metadata.csv")]
    with StatCache(tmp_path / "stat.sqlite") as cache:
        def key(**params):
            return dataset_ingredients((DatasetSource(path=data),), PreprocessParams(**params), cache)
        default, explicit = key(), key(caption_ext=".txt")
        (data / "both.caption").write_text("still not used")
        assert (key(), key(caption_ext=".txt")) == (default, explicit)
        image(data / "new.png", color=(7, 7, 7), caption=None)
        default, explicit = key(), key(caption_ext=".txt")
        (data / "new.caption").write_text("appears later")
        assert key() != default and key(caption_ext=".txt") == explicit


def test_an_image_far_below_the_target_size_is_kept_with_a_warning(tmp_path):
    image(tmp_path / "data" / "tiny.png", size=(16, 16))
    image(tmp_path / "data" / "small.png", size=(40, 40), color=(0, 0, 1))  # 1.6x: no warning
    image(tmp_path / "data" / "wide.png", size=(128, 24), color=(0, 0, 2))  # short side 24: 2.7x
    samples, report, built, logs = preprocess(tmp_path / "data", tmp_path)
    assert [s["id"] for s in samples] == ["small", "tiny", "wide"] and report["rejected"] == []
    assert [(w["path"], w["reason"]) for w in report["warnings"]] == [("tiny.png", "small_image"),
                                                                      ("wide.png", "small_image")]
    assert report["warnings"][0]["detail"].startswith("16x16 is enlarged 4.0x to cover 64x64")
    assert built.info["warnings"] == 2 and "preprocess: warning: 2 small_image: tiny.png, wide.png" in logs
    assert preprocess(tmp_path / "data", tmp_path, min_side=32)[1]["counts"] == {"too_small": 2}
