"""Exporting generated captions as sidecars (stages/caption/export.py): only generated captions, with
the dataset's caption suffix, never over a user's file without overwrite, atomically."""
from __future__ import annotations

import os

from lorapipe.stages.caption.export import export_captions
from lorapipe.stages.preprocess.sources import DatasetSource


def entry(path: str, source: str, written: str | None, generated: str | None, dataset: str = "photos") -> dict:
    final = {"written": written, "generated": generated, "replace": generated, "prefix": f"sks, {generated}"}[source]
    return {"caption": final, "source": source, "written": written, "generated": generated, "record": None,
            "path": path, "dataset": dataset}


def test_only_generated_captions_are_written_next_to_their_images(tmp_path):
    photos, art = tmp_path / "photos", tmp_path / "art"
    (photos / "sub").mkdir(parents=True)
    art.mkdir()
    (photos / "mine.txt").write_text("my own words")
    captions = {"samples": {
        "mine": entry("mine.png", "written", "my own words", None),
        "sub/new": entry("sub/new.jpg", "generated", None, "a generated caption"),
        "trig": entry("trig.png", "prefix", None, "a cat"),
        "paint": entry("paint.webp", "generated", None, "a painting", dataset="art"),
    }}
    datasets = (DatasetSource(path=photos), DatasetSource(path=art, caption_ext=".caption"))
    written, skipped = export_captions(captions, datasets, overwrite=False)
    assert sorted(written) == [art / "paint.caption", photos / "sub" / "new.txt", photos / "trig.txt"]
    assert skipped == []
    assert (photos / "sub" / "new.txt").read_text() == "a generated caption\n"
    assert (photos / "trig.txt").read_text() == "a cat\n"  # the captioner's text, not the policy's final caption
    assert (photos / "mine.txt").read_text() == "my own words"
    assert sorted(p.name for p in photos.rglob("*")) == ["mine.txt", "new.txt", "sub", "trig.txt"]  # no temp file

    again_written, again_skipped = export_captions(captions, datasets, overwrite=False)
    assert again_written == [] and {s.reason for s in again_skipped} == {"already holds this caption"}


def test_a_users_file_is_replaced_only_with_overwrite_and_never_in_place(tmp_path):
    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / "a.txt").write_text("the user's caption")
    captions = {"samples": {"a": entry("a.png", "replace", "the user's caption", "a generated one")}}
    datasets = (DatasetSource(path=photos),)

    written, skipped = export_captions(captions, datasets, overwrite=False)
    assert written == [] and [(s.path, s.reason) for s in skipped] == [
        (str(photos / "a.txt"), "a file is there already (--overwrite replaces it)")]
    assert (photos / "a.txt").read_text() == "the user's caption"

    with open(photos / "a.txt") as reader:  # a reader of the old file keeps it whole: a rename, not a rewrite
        before = os.stat(photos / "a.txt").st_ino
        assert export_captions(captions, datasets, overwrite=True) == ([photos / "a.txt"], [])
        assert reader.read() == "the user's caption"
    assert (photos / "a.txt").read_text() == "a generated one\n" and os.stat(photos / "a.txt").st_ino != before
    assert sorted(p.name for p in photos.iterdir()) == ["a.txt"]


def test_a_dataset_that_is_not_a_local_folder_is_skipped_with_its_reason(tmp_path):
    (tmp_path / "rows").mkdir()
    captions = {"samples": {"row-0": entry("row-0", "generated", None, "a row", dataset="rows")}}
    written, skipped = export_captions(captions, (DatasetSource(path=tmp_path / "rows", format="parquet"),), False)
    assert written == [] and skipped[0].path == "rows/row-0" and "not a local folder" in skipped[0].reason


def test_an_image_the_stage_could_not_read_is_listed_as_skipped(tmp_path):
    captions = {"samples": {"bad": {**entry("bad.png", "written", None, None), "caption": "", "source": "left_out"}}}
    written, skipped = export_captions(captions, (DatasetSource(path=tmp_path),), False)
    assert written == [] and [(s.path, s.reason) for s in skipped] == [
        ("photos/bad.png", "not captioned: the image could not be read (the review's warnings say why)")]
    assert list(tmp_path.iterdir()) == []
