"""train.gradient_checkpointing: each block's activations recomputed in the backward pass instead of
kept from the forward.

diffusers' own checkpoint function (`enable_gradient_checkpointing()` without one) passes a block its
inputs by position only, and some transformers give it keyword arguments: HunyuanImage 2.1's passes
`attention_mask` and `image_rotary_emb` by name, a TypeError at the first step. This one passes both
on, as torch.utils.checkpoint does without reentrance; called by position only it is diffusers'.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.utils.checkpoint


def _checkpointed(block: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    return torch.utils.checkpoint.checkpoint(block.__call__, *args, use_reentrant=False, **kwargs)


def enable_gradient_checkpointing(denoiser: torch.nn.Module) -> None:
    denoiser.enable_gradient_checkpointing(_checkpointed)
