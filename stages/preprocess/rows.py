"""dataset.json's rows, typed: what preprocess writes per sample and caption and encode read.

An image row is a file of a dataset placed in its target size (its bytes' digest, resize and crop
box, the background alpha is composited on); a clip's window is an image row with the window's
source frames. A sample row adds the caption, the split, its role and where its loss mask and an
edit pair's references come from. The on-disk form is the rows' JSON with unset fields left out:
the bytes preprocess wrote before its rows were typed, so cached artifacts read as they are.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Literal

from pydantic import ConfigDict, Field

from lorapipe.cache.fsutil import write_json_rows

from ..contract import Frozen

if TYPE_CHECKING:
    from .sources import DatasetSource

DATASET_FORMAT = 2  # dataset.json's header `format`


class PlacedImage(Frozen):
    """An image file and where preprocess placed it: an edit pair's reference on disk."""

    path: str  # relative to its dataset
    digest: str  # of its bytes (a clip window's: of the frames it shows)
    original_size: tuple[int, int]  # height, width as shown
    resized: tuple[int, int]  # height, width before the crop
    crop_box: tuple[int, int, int, int]  # left, top, right, bottom in the resized image
    background: tuple[int, int, int] | None = None  # RGB its alpha is composited on; None: no alpha
    frames: tuple[int, ...] | None = None  # a clip window's source frame indices (a conditioning image cut
    # from a clip: its one frame); None: an image

    def pixel_identity(self) -> dict:
        """What its placed pixels depend on: its bytes, resize and crop (and background, for an
        image with alpha)."""
        pixels = {"image": self.digest, "resized": list(self.resized), "crop_box": list(self.crop_box)}
        if self.background is not None:
            pixels["background"] = list(self.background)
        return pixels


class ImageRow(PlacedImage):
    """An image of a dataset in its target size, or a clip's window (`frames`): what a latent is
    encoded from."""

    id: str
    source: int  # the dataset's index
    size: tuple[int, int]  # the target: height, width
    fps: float | None = None  # the frame rate the window is sampled at
    condition_frames: int | None = None  # an image-to-video model's conditioning image: encoded as a clip of
    # this many frames, the image then zeros (Family.image_condition); None: as it is

    def pixel_identity(self) -> dict:
        padded = {"condition_frames": self.condition_frames} if self.condition_frames else {}
        return {**super().pixel_identity(), **padded}

    @property
    def is_clip(self) -> bool:
        return self.frames is not None

    @property
    def frame_count(self) -> int:
        """The window's frames; 0 for an image."""
        return len(self.frames or ())

    @property
    def encoded_frames(self) -> int:
        """The frames its latent is encoded from: the window's, a conditioning image's clip's; 0 for an image."""
        return self.condition_frames or self.frame_count

    def label(self, datasets: tuple[DatasetSource, ...]) -> str:
        """The file as the user knows it: its path, prefixed by its dataset's name when there are several."""
        return f"{datasets[self.source].label}/{self.path}" if len(datasets) > 1 else self.path


class MaskSource(Frozen):
    """What a sample's loss mask is made from: a sidecar image, or the image's own alpha channel."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    made_from: Literal["sidecar", "alpha"] = Field(alias="from")
    path: str | None = None  # a sidecar's, relative to its dataset
    digest: str | None = None  # a sidecar's bytes'


class ClipSource(Frozen):
    """The clip a window is cut from (its windows share `digest`: held out together)."""

    digest: str
    duration: float  # seconds
    fps: float  # the clip's own frame rate
    start: float  # the window's start, seconds after the clip's first frame
    cut: str  # what the clip's windows leave unused


class SampleRow(ImageRow):
    """A training or held-out sample: one row of dataset.json."""

    caption: str
    repeats: int
    split: Literal["train", "holdout"] = "train"
    role: Literal["prior"] | None = None  # an image of a prior dataset; None: the subject's
    written: Literal[False] | None = None  # False: no caption was written, the caption stage makes one
    mask: MaskSource | None = None  # None: every pixel weighs 1
    references: tuple[PlacedImage, ...] | None = None  # an edit pair's, placed in this target's size
    clip: ClipSource | None = None  # a clip window's clip

    def to_json(self) -> dict:
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


def read_rows(path: Path) -> list[SampleRow]:
    """dataset.json's samples (preprocess's, or caption's with final captions)."""
    return [SampleRow.model_validate(row) for row in json.loads(path.read_text())["samples"]]


def write_rows(path: Path, rows: Iterable[SampleRow]) -> None:
    write_json_rows(path, {"format": DATASET_FORMAT}, "samples", (row.to_json() for row in rows))
