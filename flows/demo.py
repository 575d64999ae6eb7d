"""`lorapipe demo`: a tiny SD1.x model and the bundled photos, through the whole pipeline."""
from __future__ import annotations

import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEMO_CONFIG = REPO / "configs" / "demo.yaml"
DEMO_IMAGES = REPO / "stages" / "assets" / "demo_images"


def prepare_demo(workdir: Path) -> Path:
    """Build the tiny model and copy the photos into `workdir` (once); return the config path."""
    workdir.mkdir(parents=True, exist_ok=True)
    model = workdir / "model"
    if not (model / "model_index.json").exists():
        from stages.tiny import build_tiny_model

        print(f"demo: building the tiny SD1.x model in {model}")
        build_tiny_model(model)
    data = workdir / "data"
    data.mkdir(exist_ok=True)
    for src in sorted(DEMO_IMAGES.iterdir()):
        if src.suffix in (".jpg", ".txt") and not (data / src.name).exists():
            shutil.copy2(src, data / src.name)
    config = workdir / "demo.yaml"
    shutil.copyfile(DEMO_CONFIG, config)
    return config
