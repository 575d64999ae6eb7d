"""Held-out edit pairs: each rendered from its instruction and reference image(s) by the base model
and by the LoRA at every scale, beside its reference and its target (edit_grid.png, each row
titled with the target's file), and how far each rendering is from the target (mean squared
pixel difference in [0, 1]: lower is closer).

The pairs are the held-out samples with references, at most `edit_pairs` of them, chosen as the
loss subset is (by content, so a growing dataset keeps them); their images are read from the
dataset and placed exactly as encode placed them, and each renders at its target's size. An
image-to-video model's pairs are held-out clip windows and their conditioning images: each renders
a clip from its conditioning image, compared by its first frame with the window's.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from PIL import Image

from lorapipe.stages.encode.images import placed_still
from lorapipe.stages.encode.references import reference_images
from lorapipe.stages.encoded import EncodedData
from lorapipe.stages.preprocess import DATASET_FILE
from lorapipe.stages.preprocess.rows import read_rows
from lorapipe.stages.preprocess.sources import DatasetSource

from .losses import loss_subset
from .render import clips_of, compose_grid, render_size_kwargs

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

    from lorapipe.stages.families import Family

REFERENCE, TARGET = "reference", "target"


@dataclass(frozen=True)
class EditPair:
    instruction: str
    references: list[Image.Image]
    target: Image.Image
    name: str  # the target's file, as the user knows it (its grid row's title)


def held_out_pairs(encoded: EncodedData, preprocess_dir: str, sources: dict, limit: int,
                   loss_seed: int) -> list[EditPair]:
    """Up to `limit` held-out samples with references, their images read and placed."""
    held = [s for s in encoded.split("holdout") if s.references and s.role == "train"]
    if not held or not limit or not preprocess_dir:
        return []
    datasets = tuple(DatasetSource(**d) for d in sources["sources"])
    by_id = {(datasets[s.source].label, s.id): s for s in read_rows(Path(preprocess_dir) / DATASET_FILE)}
    pairs = []
    for sample in loss_subset(held, limit, loss_seed):
        entry = by_id[(sample.dataset, sample.id)]
        images = [placed_still(datasets, image) for image in (entry, *reference_images([entry]))]
        if any(image is None for image in images):
            raise ValueError(f"evaluate: {entry.path} or its references changed since encode ran: run the"
                             " pipeline again")
        pairs.append(EditPair(sample.caption, images[1:], images[0], entry.label(datasets)))
    return pairs


@torch.inference_mode()
def render_pairs(pipe: DiffusionPipeline, family: Family, pairs: list[EditPair], seeds: list[int], steps: int,
                 family_kwargs: dict) -> list[Image.Image]:
    """One edit per (pair, seed), pair-major, with the pipeline's current adapters."""
    rendered = []
    for pair in pairs:
        for seed in seeds:
            height, width = pair.target.height, pair.target.width
            kwargs = {**family_kwargs, **family.reference_render_kwargs(pair.references),
                      **render_size_kwargs(family, height, width)}  # its own references, not the prompt grid's
            output = pipe(prompt=pair.instruction, height=height, width=width, num_inference_steps=steps,
                          generator=torch.Generator().manual_seed(seed), output_type="pil", **kwargs)
            rendered.append(clips_of(output)[0][0])
    return rendered


def edit_columns(pairs: list[EditPair], seeds: list[int], rendered: dict[str, list[Image.Image]]
                 ) -> dict[str, list[Image.Image]]:
    """The grid's columns: the (first) reference, each rendering, the target."""
    def repeated(image_of) -> list[Image.Image]:
        return [image_of(pair) for pair in pairs for _ in seeds]

    return {REFERENCE: repeated(lambda p: p.references[0]), **rendered, TARGET: repeated(lambda p: p.target)}


def pixel_distances(pairs: list[EditPair], seeds: list[int], rendered: dict[str, list[Image.Image]]
                    ) -> dict[str, float]:
    """Per rendered column: the mean squared difference to the target, pixels in [0, 1]."""
    targets = [pair.target for pair in pairs for _ in seeds]
    return {label: sum(_mse(image, target) for image, target in zip(images, targets)) / len(targets)
            for label, images in rendered.items()}


def write_edit_grid(path: Path, pairs: list[EditPair], seeds: list[int], rendered: dict[str, list[Image.Image]],
                    resolution: int) -> None:
    rows = [(pair.instruction, seed) for pair in pairs for seed in seeds]
    titles = [pair.name for pair in pairs for _ in seeds]
    compose_grid(edit_columns(pairs, seeds, rendered), rows, resolution, titles).save(path)


def _mse(image: Image.Image, target: Image.Image) -> float:
    def pixels(im: Image.Image) -> torch.Tensor:
        return torch.frombuffer(bytearray(im.convert("RGB").tobytes()), dtype=torch.uint8).float() / 255

    if image.size != target.size:
        image = image.resize(target.size, Image.BICUBIC)
    return torch.mean((pixels(image) - pixels(target)) ** 2).item()
