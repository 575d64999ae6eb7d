"""Video files read with PyAV (FFmpeg inside its wheel): what a clip holds, and its frames.

A clip is known by its decoded frames, not its bytes: `read_clip` decodes every frame once and
records each frame's presentation time and a digest of its upright RGB pixels, so a clip re-muxed
into another container, or re-encoded losslessly, keeps the digests of the frames it shows. The
caller keeps that record per file version (the stat cache), so a clip is decoded once for it.

Frames are turned upright by the stream's display matrix (a phone clip recorded sideways), as an
image is by its EXIF orientation; rotations of other than a multiple of 90 degrees are refused.
Frame times come from the frames' own timestamps, so a variable-frame-rate clip is sampled by time
like any other (and said to be variable).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from blake3 import blake3

VIDEO_SUFFIXES = (".mp4", ".webm", ".mov", ".mkv", ".gif")
# a frame interval this far from the median is a variable frame rate: 10%, or more than a GIF's
# centisecond ticks and a millisecond time base round a steady rate to
VARIABLE_RATE_TOLERANCE = (0.1, 0.011)


class VideoProblem(ValueError):
    """A file that cannot be used as a clip; `reason` is the preprocess report's reason code."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass(frozen=True)
class ClipInfo:
    width: int  # upright
    height: int
    rotation: int  # degrees counter-clockwise the display matrix turns the coded frames
    times: tuple[float, ...]  # each frame's presentation time, seconds after the first frame's
    digests: tuple[str, ...]  # each frame's upright RGB pixels, blake3, 32 hex digits

    @property
    def frame_interval(self) -> float:
        """The median time between frames (one frame's duration for a single frame: 0)."""
        gaps = np.diff(self.times)
        return float(np.median(gaps)) if len(gaps) else 0.0

    @property
    def fps(self) -> float:
        return 1 / self.frame_interval if self.frame_interval else 0.0

    @property
    def duration(self) -> float:
        """Seconds the clip shows: up to the end of its last frame."""
        return self.times[-1] + self.frame_interval

    @property
    def variable_frame_rate(self) -> bool:
        relative, seconds = VARIABLE_RATE_TOLERANCE
        gaps = np.diff(self.times)
        return bool(np.any(np.abs(gaps - self.frame_interval) > max(relative * self.frame_interval, seconds)))

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, value: dict) -> "ClipInfo":
        return cls(value["width"], value["height"], value["rotation"], tuple(value["times"]), tuple(value["digests"]))


def read_clip(path: Path) -> ClipInfo:
    """Decode every frame of the file's first video stream; VideoProblem when it cannot be a clip."""
    times, digests, size, rotation = [], [], None, 0
    for time, frame, turned in _frames(path):
        if size is None:
            size, rotation = frame.shape[:2], turned
        times.append(time)
        digests.append(frame_digest(frame))
    if not times:
        raise VideoProblem("no_frames", "the video stream holds no frame")
    start = times[0]
    return ClipInfo(size[1], size[0], rotation, tuple(round(t - start, 6) for t in times), tuple(digests))


def frame_digest(frame: np.ndarray) -> str:
    """An upright RGB frame's pixels, blake3, 32 hex digits."""
    return blake3(np.ascontiguousarray(frame).tobytes()).hexdigest()[:32]


def decode_frames(path: Path, indices: list[int]) -> np.ndarray:
    """The frames at `indices` (decode order, as read_clip numbers them; repeats allowed), upright
    RGB, as a (len(indices), H, W, 3) uint8 array."""
    wanted = set(indices)
    found: dict[int, np.ndarray] = {}
    for n, (_, frame, _) in enumerate(_frames(path)):
        if n in wanted:
            found[n] = frame
            if len(found) == len(wanted):
                break
    missing = sorted(wanted - set(found))
    if missing:
        raise VideoProblem("truncated", f"frame {missing[0]} could not be decoded (the file changed or is cut short)")
    return np.stack([found[i] for i in indices])


def _frames(path: Path):
    """(time in seconds, upright RGB array, rotation) for each decoded frame."""
    import av

    try:
        container = av.open(str(path))
    except av.FFmpegError as error:
        raise VideoProblem("not_a_video", _said(error)) from None
    decoded = 0
    with container:
        if not container.streams.video:
            what = "audio only" if container.streams.audio else "no video stream"
            raise VideoProblem("no_video", what)
        stream = container.streams.video[0]
        stream.thread_type = "NONE"  # frame order and pixels independent of the machine's cores
        try:
            for frame in container.decode(stream):
                rotation = round(frame.rotation or 0) % 360
                if rotation % 90:
                    raise VideoProblem("unsupported_rotation", f"the display matrix turns it {rotation} degrees")
                pixels = frame.to_ndarray(format="rgb24")
                decoded += 1
                yield _seconds(frame), np.rot90(pixels, k=rotation // 90), rotation
        except av.FFmpegError as error:
            if decoded:
                raise VideoProblem("truncated", f"decoding stopped after frame {decoded}: {_said(error)}") from None
            raise VideoProblem("not_a_video", _said(error)) from None


def _seconds(frame) -> float:
    if frame.pts is None or frame.time_base is None:
        raise VideoProblem("no_timestamps", "its frames carry no presentation time")
    return float(frame.pts * frame.time_base)


def _said(error: Exception) -> str:
    """FFmpeg's message without the file name it repeats."""
    return (getattr(error, "strerror", None) or str(error)).strip()
