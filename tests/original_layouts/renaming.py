"""What the original-layout writers of the 2026 families and the video VAEs share: a diffusers
state dict renamed by ordered string replacements, and diffusers' separate projections fused back
into one original weight."""
from __future__ import annotations

import torch

State = dict[str, torch.Tensor]


def replaced(key: str, pairs: tuple[tuple[str, str], ...]) -> str:
    for diffusers_part, original_part in pairs:
        key = key.replace(diffusers_part, original_part)
    return key


def fused(state: State, parts: tuple[str, ...], into: str) -> State:
    """`state` with each set of keys naming `parts` (in one module) replaced by one key naming
    `into`: the parts' rows concatenated in order, as the original checkpoint stores them."""
    out = {}
    for key, value in state.items():
        if parts[0] in key:
            out[key.replace(parts[0], into)] = torch.cat([state[key.replace(parts[0], part)] for part in parts])
        elif not any(part in key for part in parts[1:]):
            out[key] = value
    return out
