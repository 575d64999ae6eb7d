"""Z-Image's transformer in its original layout (Tongyi's checkpoint, ComfyUI's Lumina2 model):
`attention.qkv` fused q|k|v, `attention.out`, `q_norm`/`k_norm`, `x_embedder`, `final_layer`; the
inverse of diffusers' convert_z_image_transformer_checkpoint_to_diffusers."""
from __future__ import annotations

from .renaming import State, fused, replaced

NAMES = (("all_final_layer.2-1.", "final_layer."), ("all_x_embedder.2-1.", "x_embedder."),
         (".attention.to_out.0.", ".attention.out."), (".attention.norm_q.", ".attention.q_norm."),
         (".attention.norm_k.", ".attention.k_norm."))


def transformer(state: State, config: dict) -> State:
    qkv = fused(state, (".attention.to_q.", ".attention.to_k.", ".attention.to_v."), ".attention.qkv.")
    return {replaced(key, NAMES): value for key, value in qkv.items()}


WRITERS = {"ZImageTransformer2DModel": transformer}
