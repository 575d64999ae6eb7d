"""Video files read with PyAV (FFmpeg inside its wheel): what a clip holds, and its frames.

A clip is known by its decoded frames, not its bytes: `read_clip` decodes every frame once and
records each frame's presentation time and a digest of its upright RGB pixels, so a clip re-muxed
into another container, or re-encoded losslessly, keeps the digests of the frames it shows. The
caller keeps that record per file version (the stat cache), so a clip is decoded once for it.

Frames are turned upright by the stream's display matrix (a phone clip recorded sideways), as an
image is by its EXIF orientation; rotations of other than a multiple of 90 degrees, and mirrors,
are refused. A file that decodes short of the duration its container declares is truncated.
Frame times come from the frames' own timestamps, so a variable-frame-rate clip is sampled by time
like any other (and said to be variable).
"""
from __future__ import annotations

import heapq
import io
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import numpy as np
from blake3 import blake3

VIDEO_SUFFIXES = (".mp4", ".webm", ".mov", ".mkv", ".gif")
# a frame interval this far from the median is a variable frame rate: 10%, or more than a GIF's
# centisecond ticks and a millisecond time base round a steady rate to
VARIABLE_RATE_TOLERANCE = (0.1, 0.011)
# decoding this much short of the container's duration is a truncated file: frames, and seconds
SHORTFALL = (2, 0.1)


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
    """Decode every frame of the file's first video stream; VideoProblem when it cannot be a clip,
    `truncated` when less decodes than the container declares."""
    times, digests, size, rotation, last = [], [], None, 0, 0.0
    with _video_stream(path) as (container, stream):
        declared = _declared_duration(container, stream)
        for decoded in _frames(container, stream):
            pixels = decoded.pixels()
            if size is None:
                size, rotation = pixels.shape[:2], decoded.rotation
            times.append(decoded.time)
            digests.append(frame_digest(pixels))
            last = decoded.duration
    if not times:
        if declared:
            raise VideoProblem("truncated", f"no frame decodes of the {declared:.2f} s the container declares")
        raise VideoProblem("no_frames", "the video stream holds no frame")
    start = times[0]
    clip = ClipInfo(size[1], size[0], rotation, tuple(round(t - start, 6) for t in times), tuple(digests))
    _check_complete(clip, last, declared)
    return clip


def _check_complete(clip: ClipInfo, last: float, declared: float | None) -> None:
    """`truncated` when the frames end short of what the container declares; `last`: the last
    frame's own duration (a screen recording's last frame may be shown long)."""
    shown = clip.times[-1] + max(clip.frame_interval, last)
    if declared and declared - shown > max(SHORTFALL[0] * clip.frame_interval, SHORTFALL[1]):
        raise VideoProblem("truncated", f"{shown:.2f} s decodes of the {declared:.2f} s the container"
                           " declares (a partial download or copy?)")


def frame_digest(frame: np.ndarray) -> str:
    """An upright RGB frame's pixels, blake3, 32 hex digits."""
    return blake3(np.ascontiguousarray(frame).tobytes()).hexdigest()[:32]


def decode_frames(path: Path, indices: list[int]) -> np.ndarray:
    """The frames at `indices` (decode order, as read_clip numbers them; repeats allowed), upright
    RGB, as a (len(indices), H, W, 3) uint8 array."""
    wanted = set(indices)
    found: dict[int, np.ndarray] = {}
    with _video_stream(path) as (container, stream):
        for n, decoded in _numbered_from(container, stream, min(wanted), max(wanted)):
            if n in wanted:
                found[n] = decoded.pixels()
                if len(found) == len(wanted):
                    break
    missing = sorted(wanted - set(found))
    if missing:
        raise VideoProblem("truncated", f"frame {missing[0]} could not be decoded (the file changed or is cut short)")
    return np.stack([found[i] for i in indices])


class _Decoded(NamedTuple):
    pts: int
    time: float  # seconds
    duration: float  # seconds the frame says it is shown; 0: it does not say
    frame: Any  # PyAV's VideoFrame, converted to RGB only when asked (pixels)
    rotation: int

    def pixels(self) -> np.ndarray:
        """The frame upright, as RGB."""
        return np.rot90(self.frame.to_ndarray(format="rgb24"), k=self.rotation // 90)


def _numbered_from(container, stream, first: int, last: int) -> Iterator[tuple[int | None, _Decoded]]:
    """(frame number, frame) from the keyframe at or before frame `first`, for frames up to `last`:
    the same pixels as decoding from the start, without decoding what comes before. A frame's number
    is the rank of its presentation time among the packets'; a file whose packets carry no time, or
    a seek that lands after the frame, is decoded from its start."""
    times, keyframes = _packet_times(container, stream, last) if first else ([], [])
    if first < len(times):
        times.sort()
        number = {pts: n for n, pts in enumerate(times)}
        container.seek(max((k for k in keyframes if k <= times[first]), default=times[0]), stream=stream)
        numbered = ((number.get(decoded.pts), decoded) for decoded in _frames(container, stream))
        n, decoded = next(numbered, (None, None))
        if n is not None and n <= first:
            yield n, decoded
            yield from numbered
            return
        container.seek(0)
    yield from enumerate(_frames(container, stream))


def _packet_times(container, stream, last: int) -> tuple[list[int], list[int]]:
    """The presentation times of the packets that may be shown up to frame `last`, and of the
    keyframes among them (demuxed, nothing decoded); none when a packet carries no time. Packets
    come in decoding order and none is shown before it is decoded, so once one is decoded after the
    `last`-th earliest time seen, every packet from there on is shown after frame `last`."""
    times, keyframes, earliest = [], [], []  # earliest: the last + 1 earliest times, negated (a max-heap)
    for packet in container.demux(stream):
        if not packet.size:
            continue
        if packet.pts is None:
            return [], []
        if len(earliest) > last and packet.dts is not None and packet.dts > -earliest[0]:
            break
        times.append(packet.pts)
        if packet.is_keyframe:
            keyframes.append(packet.pts)
        heapq.heappush(earliest, -packet.pts)
        if len(earliest) > last + 1:
            heapq.heappop(earliest)
    return times, keyframes


@contextmanager
def _video_stream(path: Path):
    """The open file and its first video stream."""
    import av

    try:
        container = av.open(str(path))
    except av.FFmpegError as error:
        raise _unopenable(path, error) from None
    with container:
        if not container.streams.video:
            what = "audio only" if container.streams.audio else "no video stream"
            raise VideoProblem("no_video", what)
        stream = container.streams.video[0]
        stream.thread_type = "NONE"  # frame order and pixels independent of the machine's cores
        yield container, stream


def _frames(container, stream) -> Iterator[_Decoded]:
    """Each frame decoded from where the container stands."""
    import av

    decoded = 0
    try:
        for frame in container.decode(stream):
            rotation = _rotation(frame)
            decoded += 1
            shown = float(frame.duration * frame.time_base) if frame.duration else 0.0
            yield _Decoded(frame.pts, _seconds(frame), shown, frame, rotation)
    except av.FFmpegError as error:
        if decoded:
            raise VideoProblem("truncated", f"decoding stopped after frame {decoded}: {_said(error)}") from None
        raise VideoProblem("not_a_video", _said(error)) from None


def _rotation(frame) -> int:
    """Degrees counter-clockwise the display matrix turns the frame; VideoProblem when it mirrors it
    (FFmpeg's own handling of a mirror depends on the angle) or turns it off the right angles."""
    matrix = frame.side_data.get("DISPLAYMATRIX")
    if matrix is not None:
        a, b, _, c, d = (int(v) for v in np.frombuffer(memoryview(matrix), np.int32)[:5])
        if a * d - b * c < 0:
            raise VideoProblem("unsupported_rotation", "the display matrix mirrors it: re-encode it as shown")
    rotation = round(frame.rotation or 0) % 360
    if rotation % 90:
        raise VideoProblem("unsupported_rotation", f"the display matrix turns it {rotation} degrees")
    return rotation


def _declared_duration(container, stream) -> float | None:
    """Seconds of video the container says it holds: the stream's own duration, else its DURATION
    tag (Matroska), else the file's when the video is its only stream; None when it does not say."""
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if tag := stream.metadata.get("DURATION"):
        hours, minutes, seconds = tag.split(":")
        return int(hours) * 3600 + int(minutes) * 60 + float(seconds)
    if container.duration and len(container.streams) == 1:
        return container.duration / 1_000_000  # AV_TIME_BASE
    return None


def _unopenable(path: Path, error: Exception) -> VideoProblem:
    """Why FFmpeg cannot open the file: an MP4/MOV whose boxes run past its end, or that has no
    index (the moov box, which most writers put last), is cut short; anything else is not a video."""
    with open(path, "rb") as f:
        size, offset, kinds = f.seek(0, io.SEEK_END), 0, []
        while offset + 8 <= size:
            f.seek(offset)
            header = f.read(16)
            length, kind = int.from_bytes(header[:4], "big"), header[4:8]
            length = int.from_bytes(header[8:16], "big") if length == 1 else length or size - offset
            if length < 8:
                break
            kinds.append(kind)
            offset += length
    if kinds[:1] != [b"ftyp"] or (offset <= size and b"moov" in kinds):
        return VideoProblem("not_a_video", _said(error))
    if offset > size:
        where = "inside" if kinds[-1] == b"moov" else "before"
        return VideoProblem("truncated", f"it ends at byte {size} of the {offset} its boxes declare, {where} its"
                            " index (moov box), so no frame can be found (a partial download or copy?)")
    return VideoProblem("truncated", f"no index (moov box) in its {size} bytes, so no frame can be found"
                        " (a recording that was never finished?)")


def _seconds(frame) -> float:
    if frame.pts is None or frame.time_base is None:
        raise VideoProblem("no_timestamps", "its frames carry no presentation time")
    return float(frame.pts * frame.time_base)


def _said(error: Exception) -> str:
    """FFmpeg's message without the file name it repeats."""
    return (getattr(error, "strerror", None) or str(error)).strip()
