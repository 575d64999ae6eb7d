"""The edit demo's pairs, made here rather than shipped: each bundled photo is the reference
(control/<name>.jpg, its bytes unchanged) and the target is the photo with a red hat drawn on it (a
crown and a brim near the top centre, <name>.png: lossless, so the same bytes on every machine),
captioned with the edit instruction.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from PIL import Image, ImageDraw

INSTRUCTION = "add a red hat"
HAT_RED = (200, 20, 20)
CONTROL = "control"  # the edit demo's dataset control_dir
CROWN = (0.35, 0.04, 0.65, 0.22)  # (left, top, right, bottom) as fractions of the photo's sides
BRIM = (0.22, 0.19, 0.78, 0.27)


def with_red_hat(photo: Image.Image) -> Image.Image:
    """The photo (as RGB) with a red hat near its top centre."""
    target = photo.convert("RGB")
    draw = ImageDraw.Draw(target)
    draw.rectangle(scaled(CROWN, target.size), fill=HAT_RED)
    draw.ellipse(scaled(BRIM, target.size), fill=HAT_RED)
    return target


def scaled(box: tuple[float, float, float, float], size: tuple[int, int]) -> tuple[int, int, int, int]:
    width, height = size
    left, top, right, bottom = box
    return round(left * width), round(top * height), round(right * width), round(bottom * height)


def write_demo_pairs(folder: Path, photos: Path) -> list[Path]:
    """Write the pair of every .jpg in `photos` into `folder`: the target <name>.png with its <name>.txt
    instruction, and the reference control/<name>.jpg (files already there are kept); returns the targets."""
    (Path(folder) / CONTROL).mkdir(parents=True, exist_ok=True)
    targets = []
    for photo in sorted(Path(photos).glob("*.jpg")):
        target, reference = Path(folder) / f"{photo.stem}.png", Path(folder) / CONTROL / photo.name
        if not reference.exists():
            shutil.copy2(photo, reference)
        if not target.exists():
            with Image.open(photo) as image:
                with_red_hat(image).save(target)
        if not (caption := target.with_suffix(".txt")).exists():
            caption.write_text(INSTRUCTION)
        targets.append(target)
    return targets
