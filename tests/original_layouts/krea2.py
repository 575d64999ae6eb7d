"""Krea 2's transformer in Krea's original layout (`first`, `tmlp`, `txtmlp`, `txtfusion`,
`blocks.N.attn.wq`, `mlp`, `prenorm.scale`, each block's modulation flattened into `mod.lin`,
`last`): the inverse of diffusers' convert_krea2_transformer_checkpoint_to_diffusers."""
from __future__ import annotations

from .renaming import State, replaced

TOP = (("img_in.", "first."), ("time_embed.linear_1.", "tmlp.0."), ("time_embed.linear_2.", "tmlp.2."),
       ("time_mod_proj.", "tproj.1."), ("txt_in.norm.weight", "txtmlp.0.scale"), ("txt_in.linear_1.", "txtmlp.1."),
       ("txt_in.linear_2.", "txtmlp.3."), ("text_fusion.", "txtfusion."), ("transformer_blocks.", "blocks."),
       ("final_layer.linear.", "last.linear."), ("final_layer.norm.weight", "last.norm.scale"),
       ("final_layer.scale_shift_table", "last.modulation.lin"))
IN_BLOCKS = ((".attn.to_q.", ".attn.wq."), (".attn.to_k.", ".attn.wk."), (".attn.to_v.", ".attn.wv."),
             (".attn.to_out.0.", ".attn.wo."), (".attn.to_gate.", ".attn.gate."),
             (".attn.norm_q.weight", ".attn.qknorm.qnorm.scale"), (".attn.norm_k.weight", ".attn.qknorm.knorm.scale"),
             (".ff.", ".mlp."), (".norm1.weight", ".prenorm.scale"), (".norm2.weight", ".postnorm.scale"),
             (".scale_shift_table", ".mod.lin"))


def original_name(key: str) -> str:
    top = next((original + key[len(diffusers):] for diffusers, original in TOP if key.startswith(diffusers)), key)
    return replaced(top, IN_BLOCKS)


def transformer(state: State, config: dict) -> State:
    return {original_name(key): value.flatten() if key.endswith(".scale_shift_table") and key.startswith(
        "transformer_blocks.") else value for key, value in state.items()}


WRITERS = {"Krea2Transformer2DModel": transformer}
