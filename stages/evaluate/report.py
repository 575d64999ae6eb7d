"""The human-readable outputs: report.md and the checkpoint loss chart."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def _loss_rows(split: str, result: dict[str, Any], timesteps: list[int]) -> list[str]:
    if "skipped" in result:
        return [f"| {split} | - | {result['skipped']} |" + " |" * len(timesteps)]
    rows = []
    for model in ("base", "lora"):
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
    lines.append("LoRA losses are measured at scale 1, the strength it was trained at.")
    prediction = metrics["prediction_type"]
    if prediction["lora"] != prediction["base"]:
        lines.append(f"The LoRA was trained to predict {prediction['lora']} (the base model predicts"
                     f" {prediction['base']}): each is scored against its own target.")
    lines += ["", "## CLIP score", ""]
    clip = metrics["clip_score"]
    if "skipped" in clip:
        lines.append(f"Skipped: {clip['skipped']}")
    else:
        lines.append(f"base {clip['base']:.3f}; " + "; ".join(f"LoRA x{s} {v:.3f}" for s, v in clip["lora"].items()))
    lines += ["", "## Samples", "", "![base and LoRA samples](grid.png)", ""]
    if checkpoints is not None:
        lines += ["## Held-out loss by checkpoint", ""]
        if "skipped" in checkpoints:
            lines.append(f"Skipped: {checkpoints['skipped']}")
        else:
            lines += ["| step | held-out loss |", "|---|---|", f"| base | {checkpoints['base']:.5f} |"]
            lines += [f"| {c['step']} | {c['overall']:.5f} |" for c in checkpoints["checkpoints"]]
            lines += ["", "![held-out loss by checkpoint](checkpoint_loss.png)"]
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
