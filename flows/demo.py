"""`lorapipe demo [--arch ARCH]`: a tiny model of a registered family and the data its family's demo
config trains on (the bundled photos, or generated clips for a video family), through the whole
pipeline. With `--caption`, the bundled photos without their captions, captioned by the tiny
captioner (nonsense text, real plumbing) before training."""
from __future__ import annotations

from importlib.resources import files
from pathlib import Path

import yaml

from lorapipe.cache.errors import UserError

from .config import apply_override

CONFIGS = files("lorapipe.configs")


def prepare_demo(workdir: Path, arch: str, edits: bool = False, caption: bool = False) -> Path:
    """Build the tiny model of `arch` and write its demo data into `workdir` (once): edit pairs with
    `edits` or for an edit model, uncaptioned photos and the tiny captioner with `caption`; return
    the config path."""
    from lorapipe.stages import families

    workdir.mkdir(parents=True, exist_ok=True)
    model = workdir / "model"
    if not (model / "model_index.json").exists():
        print(f"demo: building the tiny {arch} model in {model}")
        families.build_tiny_model(model, arch)
    family = families.for_model(model)
    if (built := family.tiny_arch()) != arch:
        raise UserError(f"{model} holds the tiny {built} model, not {arch}: give another --workdir for the {arch} demo")
    edits = edits or family.demo_edits
    if edits:
        family.check_references(1)
    settings = family.demo_settings()
    if caption:
        if edits or family.demo_config() != "demo.yaml":
            raise UserError(f"demo --caption: captions the bundled photos, which the {arch} demo does not train on")
        settings = {**settings, **uncaptioned_demo(workdir)}
    else:
        family.write_demo_data(workdir / "data", edits)
    config = workdir / "demo.yaml"
    config.write_text(demo_config_text(family.demo_config(edits), settings))
    return config


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
