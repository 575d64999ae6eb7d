"""Captions for time ranges of a clip: a metadata row's `captions` list of {start, end, text}, in
seconds from the clip's first frame (a CSV cell holds the same list as JSON text). Each window of
the clip takes the caption of the range holding its middle (stages/preprocess/clips.py).

A clip's list the row cannot hold (not such objects, a range ending at or before its start, two
ranges overlapping, a blank text, or beside a caption column value that would be ignored) is a
`bad_caption_range` row problem naming the metadata row and `captions[i]`. An image's row is read
as before: a `captions` column there is none of this module's.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

TIMED_CAPTIONS_KEY = "captions"
BAD_RANGE = "bad_caption_range"


class BadRanges(ValueError):
    """Why a row's `captions` cannot be used (one line, naming the key)."""


@dataclass(frozen=True)
class CaptionRange:
    start: float  # seconds after the clip's first frame
    end: float
    text: str  # whitespace collapsed


@dataclass(frozen=True)
class TimedCaptions:
    ranges: tuple[CaptionRange, ...]  # in time order, none overlapping
    where: str  # the metadata row: "metadata.jsonl:3"

    def caption_at(self, seconds: float) -> str | None:
        """The caption of the range holding `seconds` (a shared boundary belongs to the later range)."""
        held = [r for r in self.ranges if r.start <= seconds <= r.end]
        return held[-1].text if held else None

    def past(self, duration: float, slack: float) -> str:
        """Why a range lies beyond a clip of `duration` seconds ("" when none does); a range may end up
        to `slack` seconds past it (a frame's length: durations are rounded differently by tools)."""
        for i, r in enumerate(self.ranges):
            if r.start >= duration or r.end > duration + slack:
                return (f"{self.where} {TIMED_CAPTIONS_KEY}[{i}] ({r.start:g}-{r.end:g} s) is outside the clip,"
                        f" which lasts {duration:.2f} s")
        return ""


def timed_captions(value: object, where: str) -> TimedCaptions | None:
    """A row's `captions` value as ranges in time order (None: the row gives none); BadRanges when
    it cannot be used."""
    if value is None or value == "":  # an empty CSV cell gives no ranges, as a missing key does
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise BadRanges(f"{TIMED_CAPTIONS_KEY} is not a JSON list of {{start, end, text}}") from None
    if not isinstance(value, list) or not value:
        raise BadRanges(f"{TIMED_CAPTIONS_KEY} must be a non-empty list of {{start, end, text}} (seconds)")
    ranges = sorted((_range(item, i) for i, item in enumerate(value)), key=lambda pair: pair[1].start)
    for (i, earlier), (j, later) in zip(ranges, ranges[1:]):
        if later.start < earlier.end:
            raise BadRanges(f"{TIMED_CAPTIONS_KEY}[{j}] ({later.start:g}-{later.end:g} s) overlaps"
                            f" {TIMED_CAPTIONS_KEY}[{i}] ({earlier.start:g}-{earlier.end:g} s)")
    return TimedCaptions(tuple(r for _, r in ranges), where)


def _range(item: object, i: int) -> tuple[int, CaptionRange]:
    key = f"{TIMED_CAPTIONS_KEY}[{i}]"
    if not isinstance(item, dict) or set(item) != {"start", "end", "text"}:
        raise BadRanges(f"{key} must be an object with exactly start, end (seconds) and text")
    start, end, text = item["start"], item["end"], item["text"]
    if any(isinstance(t, bool) or not isinstance(t, (int, float)) for t in (start, end)):
        raise BadRanges(f"{key}: start and end must be numbers of seconds")
    if start < 0 or end <= start:
        raise BadRanges(f"{key}: end {end:g} s must come after start {start:g} s, and start be 0 or more")
    if not isinstance(text, str) or not text.split():
        raise BadRanges(f"{key} has no text")
    return i, CaptionRange(float(start), float(end), " ".join(text.split()))
