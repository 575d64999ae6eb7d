"""The captioner seam: a callable from a batch of images and a prompt to their captions, loaded from a
local transformers folder by its config.json `model_type`.

Each kind is a module exposing DEFAULT_PROMPT, DEFAULT_NUM_BEAMS (its documented usage's) and a
captioner class built as `Kind(model_path, generation, dtype, device)`, `generation` being generate()'s
arguments (CaptionParams.generation): chat.py (Qwen2-VL / Qwen2.5-VL, through the processor's chat
template) and florence.py (Florence-2, through its task tokens).
"""
from __future__ import annotations

import json
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from lorapipe.cache.errors import UserError

from .params import CaptionParams

if TYPE_CHECKING:
    from PIL import Image

KINDS = {  # config.json model_type -> (module, captioner class)
    "qwen2_5_vl": ("chat", "ChatCaptioner"),
    "qwen2_vl": ("chat", "ChatCaptioner"),
    "florence2": ("florence", "FlorenceCaptioner"),
}


class Captioner(Protocol):
    def __call__(self, images: list[Image.Image], prompt: str) -> list[str]: ...


def model_type(model_path: Path) -> str:
    config = Path(model_path) / "config.json"
    try:
        return json.loads(config.read_text())["model_type"]
    except (OSError, ValueError, KeyError) as error:
        raise UserError(f"caption.model: {model_path} is not a transformers model folder (its config.json:"
                        f" {type(error).__name__}: {error})") from None


def _kind(model_path: Path) -> tuple[str, str]:
    kind = model_type(model_path)
    if kind not in KINDS:
        raise UserError(f"caption.model: {model_path} is a {kind} model; lorapipe captions with Florence-2 or"
                        " Qwen2-VL/Qwen2.5-VL models")
    return KINDS[kind]


def resolved(params: CaptionParams, model_path: Path) -> CaptionParams:
    """`params` with the prompt and num_beams the captioner's kind takes where they are unset (so
    that the stage's key and the records' keys hold what generates)."""
    kind = import_module(f"{__package__}.{_kind(model_path)[0]}")
    return params.model_copy(update={"prompt": params.prompt or kind.DEFAULT_PROMPT,
                                     "num_beams": params.num_beams or kind.DEFAULT_NUM_BEAMS})


def load_captioner(model_path: Path, params: CaptionParams, device: str, dtype) -> Captioner:
    """The captioner of `model_path`, generating as `params` say (unset ones resolved: `resolved`)."""
    module, name = _kind(model_path)
    captioner = getattr(import_module(f"{__package__}.{module}"), name)
    return captioner(Path(model_path), resolved(params, model_path).generation(), dtype, device)
