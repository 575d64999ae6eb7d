"""FLUX.3's transformer in BFL's original layout (`emb_in`, `txt_in`, `time_in`, `content_mode_blocks`,
`txt_mode_blocks`, `single_blocks` with `q_proj`/`attn_out`/`mlp_in`, modulations' `lin`, the final
layer's adaLN as [shift, scale]): the inverse of diffusers' convert_flux3_transformer_checkpoint_to_diffusers."""
from __future__ import annotations

import torch

from .renaming import State, replaced

EXACT = {"timestep_embedder.linear_1.weight": "time_in.in_layer.weight",
         "timestep_embedder.linear_2.weight": "time_in.out_layer.weight",
         "proj_out.weight": "final_layer.image.linear.weight",
         "norm_out.linear.weight": "final_layer.image.adaLN_modulation.1.weight"}
PREFIXES = (("x_embedders.", "emb_in."), ("context_embedder.", "txt_in."), ("mode_blocks.", "content_mode_blocks."),
            ("single_transformer_blocks.", "single_blocks."))
IN_BLOCKS = ((".attn.to_q.weight", ".q_proj.weight"), (".attn.to_k.weight", ".k_proj.weight"),
             (".attn.to_v.weight", ".v_proj.weight"), (".attn.to_out.0.weight", ".attn_out.weight"),
             (".attn.norm_q.weight", ".norm.query_norm.scale"), (".attn.norm_k.weight", ".norm.key_norm.scale"),
             (".ff.linear_in.weight", ".mlp_in.weight"), (".ff.linear_out.weight", ".mlp_out.weight"),
             (".linear.weight", ".lin.weight"))


def original_name(key: str) -> str:
    if key in EXACT:
        return EXACT[key]
    top = next((original + key[len(diffusers):] for diffusers, original in PREFIXES if key.startswith(diffusers)), key)
    return replaced(top, IN_BLOCKS)


def transformer(state: State, config: dict) -> State:
    """The original checkpoint's tensors: the final adaLN's halves back in BFL's order (shift, scale)."""
    return {original_name(key): torch.cat(value.chunk(2)[::-1]) if key == "norm_out.linear.weight" else value
            for key, value in state.items()}


WRITERS = {"Flux3Transformer2DModel": transformer}
