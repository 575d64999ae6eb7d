"""`lorapipe demo [--arch ARCH]`: a tiny model of a registered family and the data its family's demo
config trains on (the bundled photos, or generated clips for a video family), through the whole
pipeline. With `--caption`, the bundled photos without their captions, captioned by the tiny
captioner (nonsense text, real plumbing) before training."""
from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from lorapipe.cache.errors import UserError

from .config import apply_override

if TYPE_CHECKING:
    from lorapipe.stages.families import Family

CONFIGS = files("lorapipe.configs")


def prepare_demo(workdir: Path, arch: str, edits: bool = False, caption: bool = False) -> Path:
    """Build the tiny model of `arch` and write its demo data into `workdir` (once): edit pairs with
    `edits` or for an edit model, uncaptioned photos and the tiny captioner with `caption`; return
    the config path."""
    from lorapipe.stages import families
    from lorapipe.stages.families.folders import found_index

    workdir.mkdir(parents=True, exist_ok=True)
    model = workdir / "model"
    if found_index(model) is None:
        print(f"demo: building the tiny {arch} model in {model}")
        families.build_tiny_model(model, arch)
    family = families.for_model(model)
    if (built := family.variant.tiny_arch) != arch:
        raise UserError(f"{model} holds the tiny {built} model, not {arch}: give another --workdir for the {arch} demo")
    edits = edits or family.demo_edits
    if edits:
        families.check_references(family, 1)
    # on a model with several denoisers, the first of train.denoiser's choices
    settings = {"train.denoiser": next(iter(choices))} if (choices := family.denoiser_choices) else {}
    if caption:
        if edits or demo_config(family) != "demo.yaml":
            raise UserError(f"demo --caption: captions the bundled photos, which the {arch} demo does not train on")
        settings = {**settings, **uncaptioned_demo(workdir)}
    else:
        write_demo_data(family, workdir / "data", edits)
    config = workdir / "demo.yaml"
    config.write_text(demo_config_text(demo_config(family, edits), settings))
    return config


def demo_heading(arch: str, workdir: Path, number: int, count: int) -> str:
    """The line before each demo's output when one command runs several."""
    return f"demo {number} of {count}: {arch} in {workdir}"


def demo_config(family: Family, edits: bool = False) -> str:
    """The file in configs/ that `lorapipe demo` runs on the family's tiny model (`edits`: on edit
    pairs, for a family that takes references)."""
    if family.video:
        return "video-demo.yaml"
    return "edit-demo.yaml" if edits else "demo.yaml"


def write_demo_data(family: Family, folder: Path, edits: bool = False) -> None:
    """Write the data demo_config trains on into folder, keeping the files already there: the bundled
    photos and their captions, edit pairs generated from them (`edits`), or generated clips."""
    from lorapipe.stages.demo.clips import write_demo_clips
    from lorapipe.stages.demo.pairs import write_demo_pairs
    from lorapipe.stages.demo.photos import DEMO_PHOTOS, copy_demo_photos

    if family.video:
        write_demo_clips(folder)
    elif edits:
        write_demo_pairs(folder, DEMO_PHOTOS)
    else:
        copy_demo_photos(folder)


def uncaptioned_demo(workdir: Path) -> dict[str, str]:
    """The bundled photos without captions and the tiny captioner in `workdir` (once); the config
    settings that caption them."""
    from lorapipe.stages.demo.photos import copy_demo_photos
    from lorapipe.stages.families.tiny.captioner import build_tiny_captioner

    data, captioner = workdir / "uncaptioned", workdir / "captioner"
    copy_demo_photos(data, (".jpg",))
    if not (captioner / "config.json").exists():
        print(f"demo: building the tiny captioner in {captioner}")
        build_tiny_captioner(captioner)
    return {"data.path": data.name, "caption.model": captioner.name, "caption.max_new_tokens": "16"}


def demo_config_text(preset: str, settings: dict[str, str]) -> str:
    """The preset's text, or with `settings` set in it (its comments are then lost: a line says so)."""
    text = (CONFIGS / preset).read_text()
    if not settings:
        return text
    raw = yaml.safe_load(text)
    for key, value in settings.items():
        apply_override(raw, f"{key}={value}", "demo")
    said = ", ".join(f"{key}: {value}" for key, value in settings.items())
    return f"# configs/{preset} (see its comments) with {said} for this model\n" + yaml.safe_dump(raw, sort_keys=False)
