"""The edit demo's pairs (stages/demo_pairs.py): every bundled photo is a reference, unchanged, and
its target is the photo with a red hat where one is drawn and the photo everywhere else; the same
bytes every time they are written; the Kontext family writes them as its demo data."""
from __future__ import annotations

import numpy as np
from PIL import Image

import lorapipe.stages.families as families
from lorapipe.stages.demo_pairs import BRIM, CONTROL, CROWN, HAT_RED, INSTRUCTION, scaled, write_demo_pairs
from lorapipe.stages.families.base import DEMO_PHOTOS

PHOTOS = sorted(DEMO_PHOTOS.glob("*.jpg"))


def test_pairs_are_the_photos_with_a_red_hat(tmp_path):
    targets = write_demo_pairs(tmp_path, DEMO_PHOTOS)
    assert [t.name for t in targets] == [f"{p.stem}.png" for p in PHOTOS]
    for photo, target in zip(PHOTOS, targets):
        assert (tmp_path / CONTROL / photo.name).read_bytes() == photo.read_bytes()
        assert target.with_suffix(".txt").read_text() == INSTRUCTION
        with Image.open(photo) as original, Image.open(target) as edited:
            before, after = np.asarray(original.convert("RGB")), np.asarray(edited)
        assert after.shape == before.shape
        left, top, right, bottom = scaled(CROWN, edited.size)
        assert (after[top:bottom, left:right] == HAT_RED).all(), target.name  # the crown
        _, brim_top, _, brim_bottom = scaled(BRIM, edited.size)
        assert (after[(brim_top + brim_bottom) // 2, left:right] == HAT_RED).all()
        assert np.array_equal(after[brim_bottom + 1:], before[brim_bottom + 1:])  # below the hat: the photo


def test_pairs_are_byte_identical_when_rewritten_and_kept_when_present(tmp_path):
    first, again = write_demo_pairs(tmp_path / "a", DEMO_PHOTOS), write_demo_pairs(tmp_path / "b", DEMO_PHOTOS)
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(first, again))
    first[0].with_suffix(".txt").write_text("add a blue hat")
    write_demo_pairs(tmp_path / "a", DEMO_PHOTOS)
    assert first[0].with_suffix(".txt").read_text() == "add a blue hat"


def test_kontext_demo_trains_on_the_pairs(tmp_path):
    family = families.get("flux1-kontext")
    assert family.demo_config() == "edit-demo.yaml"
    family.write_demo_data(tmp_path)
    assert sorted(p.name for p in (tmp_path / CONTROL).iterdir()) == [p.name for p in PHOTOS]
    assert sorted(p.name for p in tmp_path.glob("*.png")) == sorted(f"{p.stem}.png" for p in PHOTOS)
