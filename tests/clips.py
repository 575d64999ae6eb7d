"""Tiny clips written with PyAV's own encoders, for the tests that read video."""
from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import av
import numpy as np


def scene(n: int, height: int = 32, width: int = 48) -> list[np.ndarray]:
    """A bright square moving right over a dark gradient: every frame different."""
    frames = []
    for i in range(n):
        frame = np.zeros((height, width, 3), np.uint8)
        frame[..., 2] = np.linspace(0, 120, width, dtype=np.uint8)
        frame[8:16, 2 * i:2 * i + 8] = (250, 200, 40)
        frames.append(frame)
    return frames


def write_clip(path: Path, frames: list[np.ndarray], codec: str = "libx264", rate: int = 16,
               pts: list[int] | None = None, rotation: int = 0, lossless: bool = True,
               keyframe_every: int | None = None, display_matrix: list[int] | None = None) -> Path:
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=rate)
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "yuv444p" if codec == "libx264" else ("rgb8" if codec == "gif" else "yuv420p")
        if codec == "libx264":
            stream.options = {"qp": "0" if lossless else "30", "threads": "1"}
        if keyframe_every:
            stream.codec_context.gop_size = keyframe_every
        if rotation:
            stream.set_display_rotation(rotation)
        if display_matrix:
            stream.set_display_matrix(display_matrix)
        if pts is not None:
            stream.codec_context.time_base = Fraction(1, 1000)
        for i, pixels in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            if pts is not None:
                frame.pts, frame.time_base = pts[i], Fraction(1, 1000)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path
