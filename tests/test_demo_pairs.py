"""The edit demo's pairs (stages/demo/pairs.py): every bundled photo is a reference, unchanged, and
its target is the photo with a red hat where one is drawn and the photo everywhere else; the same
bytes every time they are written; an edit model's demo (and another's with --edit) trains on them."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

import lorapipe.stages.families as families
from lorapipe.cache.errors import UserError
from lorapipe.flows.demo import demo_config, prepare_demo, write_demo_data
from lorapipe.stages.demo.pairs import BRIM, CONTROL, CROWN, HAT_RED, INSTRUCTION, scaled, write_demo_pairs
from lorapipe.stages.demo.photos import DEMO_PHOTOS

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


def test_edit_models_demo_on_pairs_and_others_on_request(tmp_path):
    assert families.get("flux1-kontext").demo_edits and families.get("qwen-image-edit-plus").demo_edits
    klein = families.get("flux2-klein")
    assert (demo_config(klein), demo_config(klein, edits=True)) == ("demo.yaml", "edit-demo.yaml")
    write_demo_data(klein, tmp_path, edits=True)
    assert sorted(p.name for p in (tmp_path / CONTROL).iterdir()) == [p.name for p in PHOTOS]
    assert sorted(p.name for p in tmp_path.glob("*.png")) == sorted(f"{p.stem}.png" for p in PHOTOS)


def test_an_edit_demo_of_a_model_without_references_is_refused_in_one_line(tmp_path):
    with pytest.raises(UserError, match="Stable Diffusion 1.x/2.x takes none"):
        prepare_demo(tmp_path, "sd15", edits=True)
