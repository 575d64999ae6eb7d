"""Flux components written in BFL's layout: the inverse of the row map derived from diffusers' own
converter (original_names.derive_tensor_map), so any size of transformer is written."""
from __future__ import annotations

import torch

from lorapipe.stages.lora_formats.original_names import TensorMap


def to_original(tensor_map: TensorMap, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Diffusers-named `tensors` in the original names: each original tensor its rows, in order."""
    pieces: dict[str, list] = {}
    for key, segments in tensor_map.items():
        rows = tensors[key].shape[0]
        for s in segments:
            pieces.setdefault(s.module, []).append((s.start, tensors[key][int(s.part_start * rows):int(s.part_end * rows)]))
    return {name: torch.cat([piece for _, piece in sorted(parts, key=lambda p: p[0])]) for name, parts in pieces.items()}
