"""Which frames of a clip become training samples: windows of a fixed number of frames at a target
frame rate, placed by a strategy, all keyed (preprocess.video).

A window's frames are picked by time, not by index: frame k of a window starting at s shows the
source frame nearest to s + k / fps (the earlier of two equally near), so a 30 fps and a 24 fps
clip of the same scene give windows of the same duration, and a variable frame rate clip is
sampled by its own timestamps. A clip too short for the shortest allowed window is rejected
(`too_short`, with its duration), never padded; a clip shorter than `num_frames` takes the longest
of `frame_buckets` that fits (a one-frame window needs only a frame). Nothing here decodes: the
clip's frame times come from its record (stages/video.py ClipInfo).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import Field, field_validator

from lorapipe.cache.digest import digest_json

from ..contract import Frozen
from ..video import ClipInfo, VideoProblem
from .sources import Candidate
from .timed_captions import BAD_RANGE, TIMED_CAPTIONS_KEY, TimedCaptions
from .validation import ImageInfo, Rejected


class VideoSampling(Frozen):
    """How clips are cut into training samples (images in the same datasets stay one-frame samples)."""

    fps: float = Field(16.0, gt=0, description="frames per second the windows are sampled at (Wan: 16, LTX-2: 24)")
    num_frames: int = Field(81, ge=1, description="frames per window; the model family may require a form"
                            " (Wan: 4k+1, LTX-2: 8k+1), checked when the data is encoded")
    frame_buckets: tuple[int, ...] = Field((), description="shorter window lengths a clip too short for"
                                           " num_frames may take (the longest that fits); empty: none")
    windows: Literal["head", "uniform", "sequential"] = Field(
        "head", description="head: one window from `start`; uniform: up to max_windows spread evenly over the"
        " clip; sequential: up to max_windows back to back from `start`")
    max_windows: int = Field(1, ge=1, description="windows per clip at most (uniform, sequential)")
    start: float = Field(0.0, ge=0, description="seconds skipped at the start of every clip")

    @field_validator("frame_buckets")
    @classmethod
    def _positive(cls, buckets: tuple[int, ...]) -> tuple[int, ...]:
        if any(length < 1 for length in buckets):
            raise ValueError("every frame bucket must be a positive number of frames")
        return tuple(sorted(set(buckets), reverse=True))

    def lengths(self) -> tuple[int, ...]:
        """Window lengths a clip may take, longest first."""
        return tuple(sorted({self.num_frames, *self.frame_buckets}, reverse=True))


@dataclass(frozen=True)
class Window:
    start: float  # seconds after the clip's first frame
    frames: tuple[int, ...]  # source frame indices, one per window frame (a frame may repeat)


def windows(clip: ClipInfo, sampling: VideoSampling) -> list[Window]:
    """The clip's windows; Rejected `too_short` when not even the shortest window fits."""
    usable = clip.duration - sampling.start
    length = next((n for n in sampling.lengths() if _fits(n, sampling.fps, usable)), None)
    if length is None:
        shortest = sampling.lengths()[-1]
        raise Rejected("too_short", f"{clip.duration:.2f} s long; a window of {shortest} frames at"
                       f" {sampling.fps:g} fps needs {_span(shortest, sampling.fps) + sampling.start:.2f} s"
                       + (f" (with preprocess.video.start {sampling.start:g} s)" if sampling.start else ""))
    span = _span(length, sampling.fps)
    starts = _starts(sampling, usable, span)
    return [Window(round(s, 6), _frames_at(clip, s, length, sampling.fps)) for s in starts]


def _fits(length: int, fps: float, usable: float) -> bool:
    """Whether a window of `length` frames fits in `usable` seconds; a window of one frame needs
    only a frame (a one-frame clip, which lasts no time between frames, is a one-frame window)."""
    return usable >= 0 if length == 1 else _span(length, fps) <= usable + 1e-9


def _span(length: int, fps: float) -> float:
    """Seconds a window of `length` frames covers: up to the end of its last frame."""
    return length / fps


def _starts(sampling: VideoSampling, usable: float, span: float) -> list[float]:
    fits = max(1, int((usable + 1e-9) // span))  # windows that fit back to back
    count = 1 if sampling.windows == "head" else min(sampling.max_windows, fits)
    if sampling.windows == "uniform" and count > 1:
        return list(sampling.start + np.linspace(0, usable - span, count))
    return [sampling.start + k * span for k in range(count)]


def _frames_at(clip: ClipInfo, start: float, length: int, fps: float) -> tuple[int, ...]:
    """For each window frame, the source frame nearest its time (the earlier on a tie)."""
    times = np.asarray(clip.times)
    wanted = start + np.arange(length) / fps
    after = np.clip(np.searchsorted(times, wanted, side="left"), 1, len(times) - 1)
    before = after - 1
    nearer_after = np.abs(times[after] - wanted) < np.abs(wanted - times[before])
    picked = np.where(nearer_after, after, before) if len(times) > 1 else np.zeros(length, int)
    return tuple(int(i) for i in picked)


def window_captions(clip: ClipInfo, chosen: list[Window], fps: float, timed: TimedCaptions) -> list[str]:
    """Each window's caption: that of the range holding its middle; Rejected `bad_caption_range` when
    a range lies past the clip's end or a window's middle is in no range."""
    if past := timed.past(clip.duration, clip.frame_interval):
        raise Rejected(BAD_RANGE, past)
    captions = []
    for window in chosen:
        middle = window.start + _span(len(window.frames), fps) / 2
        caption = timed.caption_at(middle)
        if caption is None:
            raise Rejected(BAD_RANGE, f"{timed.where} {TIMED_CAPTIONS_KEY}: no range holds the window at"
                           f" {window.start:.2f} s (its middle, {middle:.2f} s)")
        captions.append(caption)
    return captions


def cut_summary(clip: ClipInfo, chosen: list[Window], fps: float) -> str:
    """What of the clip the windows leave unused, for the report."""
    used = sum(len(w.frames) / fps for w in chosen)
    unused = max(0.0, clip.duration - used)
    return f"{unused:.2f} s of {clip.duration:.2f} s unused" if unused > 1e-6 else "all used"


def inspect_clip(candidate: Candidate, min_side: int) -> tuple[ImageInfo, ClipInfo]:
    """A clip candidate's frame size and content digest (of all its decoded frames), and its frames;
    Rejected naming why it cannot be used."""
    try:
        clip = candidate.clip()
    except VideoProblem as problem:
        raise Rejected(problem.reason, problem.detail) from None
    except OSError as e:
        raise Rejected("unreadable", f"cannot read the file ({e.strerror or type(e).__name__})") from None
    if min(clip.width, clip.height) < min_side:
        raise Rejected("too_small", f"{clip.width}x{clip.height} is below preprocess.min_side {min_side}")
    return ImageInfo(clip.width, clip.height, False, digest_json(clip.digests)), clip


def window_digest(clip: ClipInfo, window: Window) -> str:
    """The window's content: the digests of the frames it shows, in order (a re-muxed clip with
    the same frames has the same windows' digests)."""
    return digest_json([clip.digests[i] for i in window.frames])
