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


def flux2_map(config: dict) -> TensorMap:
    """Flux.2's row map over every tensor: its weights and its attention norms' scales (diffusers'
    converter renames only the keys it is given)."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    from lorapipe.stages.families.flux2 import seed_keys
    from lorapipe.stages.lora_formats.original_names import derive_tensor_map

    norms = [f"double_blocks.{i}.{side}_attn.norm.{qk}_norm.scale" for i in range(config["num_layers"])
             for side in ("img", "txt") for qk in ("query", "key")]
    norms += [f"single_blocks.{i}.norm.{qk}_norm.scale" for i in range(config["num_single_layers"]) for qk in ("query", "key")]
    seeds = seed_keys(config["num_layers"], config["num_single_layers"], config["guidance_embeds"]) + norms
    return derive_tensor_map(convert_flux2_transformer_checkpoint_to_diffusers, seeds)
