"""`lorapipe demo [--arch ARCH]`: a tiny model of a registered family and the bundled photos,
through the whole pipeline."""
from __future__ import annotations

import shutil
from importlib.resources import files
from pathlib import Path

from lorapipe.cache.errors import UserError

DEMO_CONFIG = files("lorapipe.configs") / "demo.yaml"
DEMO_IMAGES = Path(files("lorapipe.stages") / "assets" / "demo_images")


def prepare_demo(workdir: Path, arch: str) -> Path:
    """Build the tiny model of `arch` and copy the photos into `workdir` (once); return the config path."""
    from lorapipe.stages import families

    workdir.mkdir(parents=True, exist_ok=True)
    model = workdir / "model"
    if not (model / "model_index.json").exists():
        print(f"demo: building the tiny {arch} model in {model}")
        families.build_tiny_model(model, arch)
    elif (built := families.for_model(model).tiny_arch()) != arch:
        raise UserError(f"{model} holds the tiny {built} model, not {arch}: give another --workdir for the {arch} demo")
    data = workdir / "data"
    data.mkdir(exist_ok=True)
    for src in sorted(DEMO_IMAGES.iterdir()):
        if src.suffix in (".jpg", ".txt") and not (data / src.name).exists():
            shutil.copy2(src, data / src.name)
    config = workdir / "demo.yaml"
    config.write_text(DEMO_CONFIG.read_text())
    return config
