"""Wan's transformer and VAE in Wan's original layout (Wan-AI's checkpoints, ComfyUI's models), the
inverses of diffusers' convert_wan_transformer_to_diffusers and convert_wan_vae_to_diffusers.

Transformer: `self_attn`/`cross_attn` with `q k v o`, `k_img v_img norm_k_img` (I2V), `ffn.0`,
`modulation`, `norm3` for diffusers' cross-attention `norm2`, `time_embedding`, `img_emb.proj`,
`head`. VAE (2.1's): `conv1`/`conv2` around the latent, `downsamples` and `upsamples` as flat lists
(a decoder level: its residual blocks, then its upsampler), `middle.0-2`, `head`, residual blocks as
`residual.0/2/3/6` and `shortcut`. Wan 2.2's residual VAE has another layout, which diffusers' single
file loader does not read.
"""
from __future__ import annotations

import re

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


RESIDUAL = (("norm1.", "residual.0."), ("conv1.", "residual.2."), ("norm2.", "residual.3."),
            ("conv2.", "residual.6."), ("conv_shortcut.", "shortcut."))
VAE_TOP = (("quant_conv.", "conv1."), ("post_quant_conv.", "conv2."), ("encoder.conv_in.", "encoder.conv1."),
           ("decoder.conv_in.", "decoder.conv1."), ("encoder.norm_out.", "encoder.head.0."),
           ("encoder.conv_out.", "encoder.head.2."), ("decoder.norm_out.", "decoder.head.0."),
           ("decoder.conv_out.", "decoder.head.2."), ("encoder.mid_block.attentions.0.", "encoder.middle.1."),
           ("decoder.mid_block.attentions.0.", "decoder.middle.1."))


def _residual(rest: str) -> str:
    return next((original + rest[len(part):] for part, original in RESIDUAL if rest.startswith(part)), rest)


def vae_name(key: str, res_blocks: int) -> str:
    """The original name of a diffusers AutoencoderKLWan (2.1) weight with `res_blocks` per level."""
    top = next((original + key[len(part):] for part, original in VAE_TOP if key.startswith(part)), None)
    if top is not None:
        return top
    if m := re.match(r"(encoder|decoder)\.mid_block\.resnets\.(\d+)\.(.*)", key):
        return f"{m[1]}.middle.{2 * int(m[2])}.{_residual(m[3])}"
    if m := re.match(r"encoder\.down_blocks\.(\d+)\.(.*)", key):
        return f"encoder.downsamples.{m[1]}.{_residual(m[2])}"
    if m := re.match(r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.*)", key):
        return f"decoder.upsamples.{int(m[1]) * (res_blocks + 2) + int(m[2])}.{_residual(m[3])}"
    if m := re.match(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.*)", key):
        return f"decoder.upsamples.{int(m[1]) * (res_blocks + 2) + res_blocks + 1}.{m[2]}"
    raise ValueError(f"no original Wan VAE name for {key}")


def vae(state: State, config: dict) -> State:
    if config.get("is_residual"):
        raise ValueError("Wan 2.2's residual VAE has no original-layout writer (diffusers cannot read one)")
    return {vae_name(key, config["num_res_blocks"]): value for key, value in state.items()}


WRITERS = {"WanTransformer3DModel": transformer, "AutoencoderKLWan": vae}
