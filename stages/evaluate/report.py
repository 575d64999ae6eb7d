"""The human-readable outputs: report.md, the checkpoint loss chart, and the report with its
images inlined for viewers that cannot reach the files next to it (the Prefect UI)."""
from __future__ import annotations

import base64
import io
import re
from pathlib import Path
from typing import Any

from .params import ANIMATED_GRID, CHECKPOINT_CHART, CLIPS_DIR, GRID

EMBED_MAX_SIDE = 2048  # px: as wide as a screen shows; keeps a grid's prompt labels readable
EMBED_MAX_BYTES = 1_500_000  # per image before base64: the UI fetches an artifact as one JSON document
LOCAL_IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)\s/:]+\.(?:png|jpe?g|webp))\)")  # a file next to the report
MIME = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}  # an animated WebP stays animated


def _loss_rows(split: str, result: dict[str, Any], timesteps: list[int]) -> list[str]:
    if "skipped" in result:
        return [f"| {split} | - | {result['skipped']} |" + " |" * len(timesteps)]
    rows = []
    for model in [m for m in ("base", "lora", "ema") if m in result]:
        loss = result[model]
        cells = [f"{loss['by_timestep'][str(t)]:.5f}" for t in timesteps]
        rows.append(f"| {split} | {model} | {loss['overall']:.5f} | " + " | ".join(cells) + " |")
    return rows


def write_report(
    path: Path, metrics: dict[str, Any], timesteps: list[int], checkpoints: dict[str, Any] | None
) -> None:
    lines = ["# Evaluation", "", "## Denoising loss (lower is better)", ""]
    lines.append("| split | model | overall | " + " | ".join(f"t={t}" for t in timesteps) + " |")
    lines.append("|---" * (3 + len(timesteps)) + "|")
    for split in ("holdout", "train"):
        lines += _loss_rows(split, metrics["loss"][split], timesteps)
    scored, total = metrics["n_samples"], metrics["n_samples_in_split"]
    lines += ["", "Samples scored: " + ", ".join(
        f"{scored[name]} {label}" + (f" (a fixed subset of {total[name]})" if scored[name] < total[name] else "")
        for name, label in (("train", "train"), ("holdout", "held out")))]
    lines.append("LoRA losses are measured at scale 1, the strength it was trained at"
                 + ("; ema is the average of its weights (train.ema_decay)." if "ema" in metrics["loss"]["holdout"]
                    else "."))
    prediction = metrics["prediction_type"]
    if prediction["lora"] != prediction["base"]:
        lines.append(f"The LoRA was trained to predict {prediction['lora']} (the base model predicts"
                     f" {prediction['base']}): each is scored against its own target.")
    lines += ["", "## CLIP score", ""]
    clip = metrics["clip_score"]
    if "skipped" in clip:
        lines.append(f"Skipped: {clip['skipped']}")
    else:
        lines.append(f"base {clip['base']:.3f}; " + "; ".join(f"{label} x{s} {v:.3f}" for model, label in
                                                             (("lora", "LoRA"), ("ema", "EMA")) if model in clip
                                                             for s, v in clip[model].items()))
    grid = ANIMATED_GRID if metrics.get("clips") else GRID
    lines += ["", "## Samples", "", f"![base and LoRA samples]({grid})", ""]
    if metrics.get("clips"):
        lines += [f"Each clip as an mp4 at {metrics['clip_fps']:g} fps: {CLIPS_DIR}/<column>/<row>.mp4", ""]
    if checkpoints is not None:
        lines += ["## Held-out loss by checkpoint", ""]
        if "skipped" in checkpoints:
            lines.append(f"Skipped: {checkpoints['skipped']}")
        else:
            lines += ["| step | held-out loss |", "|---|---|", f"| base | {checkpoints['base']:.5f} |"]
            lines += [f"| {c['step']} | {c['overall']:.5f} |" for c in checkpoints["checkpoints"]]
            lines += ["", f"![held-out loss by checkpoint]({CHECKPOINT_CHART})"]
        lines.append("")
    lines += ["## Provenance", "", "| input | digest |", "|---|---|"]
    lines += [f"| {name} | `{digest}` |" for name, digest in sorted(metrics["provenance"].items())]
    path.write_text("\n".join(lines) + "\n")


def plot_checkpoint_losses(path: Path, checkpoints: dict[str, Any]) -> None:
    """Line chart of held-out loss by step, base as a dashed line. Byte-stable: no Software tag."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(5, 3), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    steps = [c["step"] for c in checkpoints["checkpoints"]]
    axes.plot(steps, [c["overall"] for c in checkpoints["checkpoints"]], marker="o", label="LoRA")
    axes.axhline(checkpoints["base"], linestyle="--", color="gray", label="base")
    axes.set_xlabel("step")
    axes.set_ylabel("held-out denoising loss")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, format="png", metadata={"Software": None})


def embed_images(markdown: str, folder: Path) -> str:
    """`markdown` with every image it links from `folder` inlined as a data: URI (downscaled to fit
    EMBED_MAX_SIDE and EMBED_MAX_BYTES). An image that cannot be read becomes a line saying so."""

    def inline(link: re.Match) -> str:
        alt, name = link[1], link[2]
        try:
            uri, note = data_uri(folder / name)
        except OSError as error:  # a missing or undecodable file (PIL's UnidentifiedImageError is one)
            return f"*{alt}: {name} could not be shown here ({error})*"
        return f"![{alt}]({uri})" + (f"\n\n*{note}*" if note else "")

    return LOCAL_IMAGE.sub(inline, markdown)


def data_uri(path: Path, max_side: int = EMBED_MAX_SIDE, max_bytes: int = EMBED_MAX_BYTES) -> tuple[str, str]:
    """(the image at `path` as a data: URI, a note saying so when it was downscaled, else ""): the
    file as is when it fits `max_side` and `max_bytes`, else smaller, as PNG if that fits and JPEG
    otherwise, halving the size until one does. Raises OSError when the file cannot be read."""
    from PIL import Image

    with Image.open(path) as image:
        image.load()
    width, height = image.size
    if image.format in MIME and max(width, height) <= max_side and path.stat().st_size <= max_bytes:
        return _data(MIME[image.format], path.read_bytes()), ""
    scale = min(1.0, max_side / max(width, height))
    while True:
        size = (max(1, round(width * scale)), max(1, round(height * scale)))
        shown = image.convert("RGB").resize(size, Image.Resampling.LANCZOS)
        for kind, options in (("PNG", {}), ("JPEG", {"quality": 90})):
            buffer = io.BytesIO()
            shown.save(buffer, kind, **options)
            if buffer.tell() <= max_bytes:
                note = f"Shown at {size[0]}x{size[1]} ({kind}); full size {width}x{height}: {path.name}"
                return _data(MIME[kind], buffer.getvalue()), note
        scale /= 2


def _data(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"
