"""The demo's clips, made here rather than shipped: short scenes of a ball crossing a landscape,
drawn with numpy and encoded with PyAV's libx264 (one thread: the same bytes on every machine with
the same PyAV), each with a caption that says what moves where.
"""
from __future__ import annotations

from collections.abc import Iterable
from itertools import chain
from pathlib import Path

import numpy as np

FPS = 16
FRAMES = 41  # 2.56 s: room for Wan's 33-frame windows (4k+1) and LTX-2's 33 (8k+1)
SIZE = 64
SCENES = (  # (name, ball colour, sky colour, direction, caption)
    ("red-ball-right", (220, 40, 40), (110, 160, 230), 1, "a red ball rolling to the right across a green field"),
    ("red-ball-left", (220, 40, 40), (110, 160, 230), -1, "a red ball rolling to the left across a green field"),
    ("yellow-ball-right", (240, 210, 40), (40, 50, 110), 1, "a yellow ball rolling to the right at night"),
    ("yellow-ball-left", (240, 210, 40), (40, 50, 110), -1, "a yellow ball rolling to the left at night"),
    ("blue-ball-right", (40, 80, 220), (230, 170, 110), 1, "a blue ball rolling to the right at sunset"),
    ("blue-ball-left", (40, 80, 220), (230, 170, 110), -1, "a blue ball rolling to the left at sunset"),
)


def frame(ball: tuple[int, int, int], sky: tuple[int, int, int], direction: int, t: float) -> np.ndarray:
    """The scene at t in [0, 1]: sky above a field, the ball's centre moving across."""
    y, x = np.mgrid[0:SIZE, 0:SIZE]
    image = np.empty((SIZE, SIZE, 3), np.uint8)
    image[:] = sky
    image[y > SIZE * 0.6] = (60, 150, 60)
    centre_x = SIZE * (0.15 + 0.7 * (t if direction > 0 else 1 - t))
    inside = (x - centre_x) ** 2 + (y - SIZE * 0.55) ** 2 <= (SIZE * 0.12) ** 2
    image[inside] = ball
    return image


def write_demo_clips(folder: Path) -> list[Path]:
    """Write every scene as <name>.mp4 with its <name>.txt caption into `folder` (files already there are kept)."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, ball, sky, direction, caption in SCENES:
        path = folder / f"{name}.mp4"
        if not path.exists():
            write_clip(path, (frame(ball, sky, direction, k / (FRAMES - 1)) for k in range(FRAMES)), FPS)
        if not (folder / f"{name}.txt").exists():
            (folder / f"{name}.txt").write_text(caption)
        written.append(path)
    return written


def write_clip(path: Path, frames: Iterable[np.ndarray], fps: int) -> None:
    """RGB frames (H, W, 3 uint8, sides even) as an H.264 mp4, encoded on one thread."""
    import av

    frames = iter(frames)
    first = next(frames)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.height, stream.width = first.shape[:2]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "18", "threads": "1"}
        for pixels in chain([first], frames):
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
