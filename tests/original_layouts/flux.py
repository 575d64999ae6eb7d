"""Flux.2's row map over every tensor, for writing its transformer in BFL's layout (the harness's
to_original; Flux.1's map is the family's own, flux1.tensor_map)."""
from __future__ import annotations

from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

from lorapipe.stages.families.flux2 import seed_keys
from lorapipe.stages.lora_formats.original_names import TensorMap, derive_tensor_map


def flux2_map(config: dict) -> TensorMap:
    """Flux.2's row map over every tensor: its weights and its attention norms' scales (diffusers'
    converter renames only the keys it is given)."""
    norms = [f"double_blocks.{i}.{side}_attn.norm.{qk}_norm.scale" for i in range(config["num_layers"])
             for side in ("img", "txt") for qk in ("query", "key")]
    norms += [f"single_blocks.{i}.norm.{qk}_norm.scale" for i in range(config["num_single_layers"])
              for qk in ("query", "key")]
    seeds = seed_keys(config["num_layers"], config["num_single_layers"], config["guidance_embeds"]) + norms
    return derive_tensor_map(convert_flux2_transformer_checkpoint_to_diffusers, seeds)
