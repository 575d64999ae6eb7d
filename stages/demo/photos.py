"""The bundled demo photos, each with a `.txt` caption beside it."""
from __future__ import annotations

import shutil
from importlib.resources import files
from pathlib import Path

DEMO_PHOTOS = Path(files("lorapipe.stages") / "assets" / "demo_images")


def copy_demo_photos(folder: Path, suffixes: tuple[str, ...] = (".jpg", ".txt")) -> None:
    """Copy the bundled files with these suffixes into folder, keeping the files already there."""
    folder.mkdir(parents=True, exist_ok=True)
    for src in sorted(DEMO_PHOTOS.iterdir()):
        if src.suffix in suffixes and not (folder / src.name).exists():
            shutil.copy2(src, folder / src.name)
