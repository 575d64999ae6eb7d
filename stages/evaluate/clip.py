"""CLIP score (100 x cosine of image and prompt embeddings, floored at 0, as in torchmetrics).

Only from a CLIP model on local disk. A model that is missing or does not load is reported as
skipped with the reason: never a crash, never a number from a model we did not run.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from PIL import Image

if TYPE_CHECKING:
    from transformers import CLIPModel, CLIPProcessor


def load_clip(path: str) -> tuple[CLIPModel, CLIPProcessor] | str:
    """(model, processor), or the one-line reason it could not be loaded."""
    if not Path(path).is_dir():
        return f"CLIP model {path} does not exist: set clip_model to a local CLIP folder or leave it unset"
    from transformers import CLIPModel, CLIPProcessor

    try:
        return CLIPModel.from_pretrained(path).eval(), CLIPProcessor.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError) as error:  # what a broken or foreign folder raises
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return f"CLIP model {path} could not be loaded: {first_line}"


@torch.inference_mode()
def clip_score(model: CLIPModel, processor: CLIPProcessor, images: list[Image.Image], prompts: list[str]) -> float:
    """Mean CLIP score of images[i] against prompts[i]."""
    inputs = processor(text=prompts, images=images, return_tensors="pt", padding=True, truncation=True)
    output = model(**{name: value.to(model.device) for name, value in inputs.items()})
    cosine = (output.image_embeds * output.text_embeds).sum(dim=-1)  # both come normalised
    return (100 * cosine.clamp(min=0)).double().mean().item()
