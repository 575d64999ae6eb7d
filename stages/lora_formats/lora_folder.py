"""A trained LoRA's folder: the names under which train publishes its files and evaluate and the
flows read them.

    LORA_FILE                          the adapter in diffusers format (load_lora_weights' default name)
    the family's other formats         beside it (LORA_FILES: every name a family may write)
    each name _<denoiser>              instead, a run that trains several denoisers (expert_file)
    EMA_DIR/                           the same files of the weights' average (train.ema_decay)
    TRAIN_CONFIG                       what trained it: settings, target modules, digests, family
    CHECKPOINTS/step-XXXXXX/LORA_FILE  the adapter of every retained checkpoint
"""
from __future__ import annotations

from pathlib import Path

from .original_names import COMFYUI, KOHYA

LORA_FILE = "pytorch_lora_weights.safetensors"
LORA_FILES = (LORA_FILE, KOHYA.file, COMFYUI.file)
EMA_DIR = "ema"
TRAIN_CONFIG = "train_config.json"
CHECKPOINTS = "checkpoints"


def expert_file(name: str, denoiser: str) -> str:
    """A LoRA file's name for one denoiser of several (`pytorch_lora_weights_high_noise.safetensors`,
    as ComfyUI workflows name a Wan 2.2 A14B pair); `name` itself for the one denoiser a run trains ('')."""
    stem, dot, suffix = name.rpartition(".")
    return f"{stem}_{denoiser}{dot}{suffix}" if denoiser else name


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def checkpoint_lora(folder: Path, step: int) -> Path:
    """The LoRA file of the checkpoint at `step` in a LoRA folder."""
    return Path(folder) / CHECKPOINTS / step_name(step) / LORA_FILE


def checkpoint_loras(folder: Path, name: str = LORA_FILE) -> list[tuple[int, Path]]:
    """(step, LoRA file `name`) of every checkpoint a LoRA folder keeps, oldest first."""
    found = []
    for path in (Path(folder) / CHECKPOINTS).glob(f"step-*/{name}"):
        step = path.parent.name.removeprefix("step-")
        if step.isdigit():
            found.append((int(step), path))
    return sorted(found)
