"""Wan's transformer and VAE in Wan's original layout (Wan-AI's checkpoints, ComfyUI's models); the
transformer by the inverse of diffusers' convert_wan_transformer_to_diffusers.

Transformer: `self_attn`/`cross_attn` with `q k v o`, `k_img v_img norm_k_img` (I2V), `ffn.0`,
`modulation`, `norm3` for diffusers' cross-attention `norm2`, `time_embedding`, `img_emb.proj`,
`head`. VAE (2.1's): the family's own name map (stages/families/wan_vae_names.py), which converts
such files at any depth; the tests check it against diffusers' at the published depth.
"""
from __future__ import annotations

from lorapipe.stages.families.wan_vae_names import original_name

from .renaming import State, replaced

IN_MODEL = (("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
            ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
            ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
            ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
            ("condition_embedder.time_proj", "time_projection.1"),
            ("condition_embedder.image_embedder.norm1", "img_emb.proj.0"),
            ("condition_embedder.image_embedder.ff.net.0.proj", "img_emb.proj.1"),
            ("condition_embedder.image_embedder.ff.net.2", "img_emb.proj.3"),
            ("condition_embedder.image_embedder.norm2", "img_emb.proj.4"),
            (".attn1.", ".self_attn."), (".attn2.", ".cross_attn."), (".to_out.0.", ".o."), (".to_q.", ".q."),
            (".to_k.", ".k."), (".to_v.", ".v."), (".add_k_proj.", ".k_img."), (".add_v_proj.", ".v_img."),
            (".norm_added_k.", ".norm_k_img."), ("ffn.net.0.proj", "ffn.0"), ("ffn.net.2", "ffn.2"),
            (".norm2.", ".norm3."), (".scale_shift_table", ".modulation"))
HEAD = {"scale_shift_table": "head.modulation", "proj_out.weight": "head.head.weight",
        "proj_out.bias": "head.head.bias"}


def transformer(state: State, config: dict) -> State:
    return {HEAD.get(key) or replaced(key, IN_MODEL): value for key, value in state.items()}


def vae(state: State, config: dict) -> State:
    return {original_name(key, config["num_res_blocks"]): value for key, value in state.items()}


WRITERS = {"WanTransformer3DModel": transformer, "AutoencoderKLWan": vae}
