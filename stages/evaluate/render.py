"""Samples for fixed prompts and seeds, and the labelled comparison grid.

Every sample gets its own CPU generator seeded with its seed, so it depends on its prompt, seed
and settings, not on what was rendered before it (batch size: see EvalOptions). A sample is a clip:
a list of frames, one for an image model (clips_of). The grid shows each clip's first frame;
where clips have more, the grid is also written animated (every cell at its k-th frame), and each
clip as an mp4 of its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from PIL import Image, ImageDraw, ImageFont

from .params import ANIMATED_GRID, CLIPS_DIR

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

    from lorapipe.stages.families import Family

LABEL_WIDTH = 160  # left column of the grid: prompt and seed of each row
HEADER_HEIGHT = 20  # top row of the grid: base or LoRA scale of each column
FONT_SIZE = 11


@dataclass(frozen=True)
class RenderSettings:
    prompts: list[str]
    seeds: list[int]
    num_inference_steps: int
    resolution: int
    batch_size: int
    family_kwargs: dict[str, Any]  # the family's pipeline arguments: guidance, negative prompt (one per
    # prompt, as the pipelines want a list with a list of prompts), text length, a clip's frames


Clip = list[Image.Image]  # a rendered sample's frames (one for an image)


@torch.inference_mode()
def render_column(pipe: DiffusionPipeline, settings: RenderSettings) -> list[Clip]:
    """One clip per (prompt, seed), prompt-major, with the pipeline's current adapters."""
    clips: list[Clip] = []
    for prompt in settings.prompts:
        for start in range(0, len(settings.seeds), settings.batch_size):
            seeds = settings.seeds[start:start + settings.batch_size]
            per_prompt = {k: [v] * len(seeds) if k == "negative_prompt" else v for k, v in settings.family_kwargs.items()}
            clips += clips_of(pipe(
                prompt=[prompt] * len(seeds), generator=[torch.Generator().manual_seed(seed) for seed in seeds],
                num_inference_steps=settings.num_inference_steps, height=settings.resolution,
                width=settings.resolution, output_type="pil", **per_prompt,
            ))
    return clips


def clips_of(output: Any) -> list[Clip]:
    """The pipeline's output as clips: a video pipeline's frames, or its images (its first field, whatever
    its name: `images`, or Kandinsky5T2IPipeline's `image`) as one-frame clips."""
    frames = getattr(output, "frames", None)
    return [list(clip) for clip in frames] if frames is not None else [[image] for image in output[0]]


def render_size_kwargs(family: Family, height: int, width: int) -> dict[str, Any]:
    """The pipeline call's arguments, besides height and width, that keep its output at that size (a
    pipeline that rescales to an area of its own is given this one)."""
    return {family.render_area_argument: height * width} if family.render_area_argument else {}


def first_frames(columns: dict[str, list[Clip]]) -> dict[str, list[Image.Image]]:
    """Each clip as one image: its first frame (what the still grid and the image metrics read)."""
    return {label: [clip[0] for clip in clips] for label, clips in columns.items()}


def write_clips(columns: dict[str, list[Clip]], rows: list[tuple[str, int]], resolution: int, fps: float,
                out_dir: Path) -> list[str]:
    """Where clips have more than one frame: the animated grid (grid.webp) and clips/<column>/
    <row>.mp4; returns the files written (none for images)."""
    frames = max(len(clip) for clips in columns.values() for clip in clips)
    if frames == 1:
        return []
    animated = [compose_grid({label: [clip[min(k, len(clip) - 1)] for clip in clips] for label, clips in columns.items()},
                             rows, resolution) for k in range(frames)]
    animated[0].save(out_dir / ANIMATED_GRID, save_all=True, append_images=animated[1:], duration=round(1000 / fps),
                     loop=0, lossless=True)
    written = [ANIMATED_GRID]
    for c, (label, clips) in enumerate(columns.items()):
        for r, clip in enumerate(clips):
            name = f"{CLIPS_DIR}/{c:02d}-{_slug(label)}/{r:02d}-seed{rows[r][1]}.mp4"
            write_mp4(clip, fps, out_dir / name)
            written.append(name)
    return written


def write_mp4(frames: Clip, fps: float, path: Path) -> None:
    """H.264 in MP4 (yuv420p: what every player plays) at `fps` (a fraction: 23.976 is 24000/1001),
    one encoder thread: the same bytes each time."""
    import av
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    width, height = (side - side % 2 for side in frames[0].size)  # yuv420p needs even sides
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": "18", "threads": "1"}
        for image in frames:
            pixels = np.asarray(image.convert("RGB"))[:height, :width]
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(pixels), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def _slug(label: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in label).strip("-").lower()


def grid_size(rows: int, columns: int, resolution: int) -> tuple[int, int]:
    return LABEL_WIDTH + columns * resolution, HEADER_HEIGHT + rows * resolution


def compose_grid(
    columns: dict[str, list[Image.Image]], rows: list[tuple[str, int]], resolution: int, titles: list[str] = ()
) -> Image.Image:
    """Columns side by side under their labels; each row labelled with its (prompt, seed), under
    its title where `titles` gives one per row (an edit pair's target file)."""
    grid = Image.new("RGB", grid_size(len(rows), len(columns), resolution), "white")
    draw = ImageDraw.Draw(grid)
    font = ImageFont.load_default(size=FONT_SIZE)
    for c, (label, images) in enumerate(columns.items()):
        x = LABEL_WIDTH + c * resolution
        draw.text((x + 2, 4), _fit(draw, label, resolution - 4, font), fill="black", font=font)
        for r, image in enumerate(images):
            grid.paste(image.convert("RGB").resize((resolution, resolution)), (x, HEADER_HEIGHT + r * resolution))
    line_height = FONT_SIZE + 3
    for r, (prompt, seed) in enumerate(rows):
        title = [_fit(draw, titles[r], LABEL_WIDTH - 8, font, tail=True)] if titles else []
        lines = [*title, *_wrap(draw, prompt, LABEL_WIDTH - 8, font, max(1, resolution // line_height - 1 - len(title)))]
        lines.append(f"seed {seed}")
        for i, line in enumerate(lines):
            draw.text((4, HEADER_HEIGHT + r * resolution + 2 + i * line_height), line, fill="black", font=font)
    return grid


def cell(grid: Image.Image, row: int, column: int, resolution: int) -> Image.Image:
    """The image at (row, column) of a grid made by compose_grid."""
    x, y = LABEL_WIDTH + column * resolution, HEADER_HEIGHT + row * resolution
    return grid.crop((x, y, x + resolution, y + resolution))


def _fit(draw: ImageDraw.ImageDraw, text: str, width: int, font: ImageFont.FreeTypeFont, tail: bool = False) -> str:
    """`text` shortened with an ellipsis to `width`; with `tail`, its end kept (a path's file name)."""
    if draw.textlength(text, font=font) <= width:
        return text
    while text and draw.textlength(text + "...", font=font) > width:
        text = text[1:] if tail else text[:-1]
    return "..." + text if tail else text + "..."


def _wrap(draw: ImageDraw.ImageDraw, text: str, width: int, font: ImageFont.FreeTypeFont, max_lines: int) -> list[str]:
    """Greedy word wrap; the last line keeps what is left, shortened with an ellipsis."""
    lines: list[str] = []
    words = text.split()
    while words and len(lines) < max_lines - 1:
        line = words.pop(0)
        while words and draw.textlength(f"{line} {words[0]}", font=font) <= width:
            line = f"{line} {words.pop(0)}"
        lines.append(_fit(draw, line, width, font))
    if words:
        lines.append(_fit(draw, " ".join(words), width, font))
    return lines
