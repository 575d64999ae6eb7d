"""LTX-2's transformer and video VAE in Lightricks' original layout (their single checkpoint, under
`model.diffusion_model.` and `vae.`; ComfyUI's models), the inverses of diffusers'
convert_ltx2_transformer_to_diffusers and convert_ltx2_vae_to_diffusers.

Transformer: `patchify_proj`, `adaln_single` (diffusers' `time_embed`), the audio-video
cross-attention modulations as `av_ca_*_adaln_single` and `scale_shift_table_a2v_ca_*`, `q_norm`/
`k_norm`; the rest as diffusers names it. VAE: the encoder's `down_blocks` and the decoder's
`up_blocks` as flat lists, each level's resnets (`res_blocks`) and its resampler one entry each, the
middle block last in the encoder and first in the decoder; the latent statistics as
`per_channel_statistics.*`.
"""
from __future__ import annotations

import re

from .renaming import State, replaced

TOP = (("time_embed.", "adaln_single."), ("audio_time_embed.", "audio_adaln_single."),
       ("proj_in.", "patchify_proj."), ("audio_proj_in.", "audio_patchify_proj."))
IN_MODEL = (("av_cross_attn_video_scale_shift", "av_ca_video_scale_shift_adaln_single"),
            ("av_cross_attn_video_a2v_gate", "av_ca_a2v_gate_adaln_single"),
            ("av_cross_attn_audio_scale_shift", "av_ca_audio_scale_shift_adaln_single"),
            ("av_cross_attn_audio_v2a_gate", "av_ca_v2a_gate_adaln_single"),
            ("video_a2v_cross_attn_scale_shift_table", "scale_shift_table_a2v_ca_video"),
            ("audio_a2v_cross_attn_scale_shift_table", "scale_shift_table_a2v_ca_audio"),
            ("norm_q", "q_norm"), ("norm_k", "k_norm"))


def transformer(state: State, config: dict) -> State:
    out = {}
    for key, value in state.items():
        top = next((original + key[len(part):] for part, original in TOP if key.startswith(part)), key)
        out[replaced(top, IN_MODEL)] = value
    return out


STATISTICS = {"latents_mean": "per_channel_statistics.mean-of-means",
              "latents_std": "per_channel_statistics.std-of-means"}


def vae_name(key: str, levels: int) -> str:
    """The original name of a diffusers AutoencoderKLLTX2Video weight of an encoder with `levels`."""
    rules = ((r"encoder\.down_blocks\.(\d+)\.resnets\.", lambda i: f"encoder.down_blocks.{2 * i}.res_blocks."),
             (r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", lambda i: f"encoder.down_blocks.{2 * i + 1}."),
             (r"encoder\.mid_block\.resnets\.", lambda: f"encoder.down_blocks.{2 * levels}.res_blocks."),
             (r"decoder\.mid_block\.resnets\.", lambda: "decoder.up_blocks.0.res_blocks."),
             (r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.", lambda i: f"decoder.up_blocks.{2 * i + 1}."),
             (r"decoder\.up_blocks\.(\d+)\.resnets\.", lambda i: f"decoder.up_blocks.{2 * i + 2}.res_blocks."))
    for pattern, original in rules:
        if m := re.match(pattern, key):
            return original(*map(int, m.groups())) + key[m.end():]
    return STATISTICS.get(key, key)


def vae(state: State, config: dict) -> State:
    return {vae_name(key, len(config["down_block_types"])): value for key, value in state.items()}


WRITERS = {"LTX2VideoTransformer3DModel": transformer, "AutoencoderKLLTX2Video": vae}
