"""Wan 2.1's VAE (`Wan2.1_VAE`, also Wan 2.2 A14B's) between its original layout and diffusers'
AutoencoderKLWan names, at any depth: diffusers' convert_wan_vae_to_diffusers numbers the decoder's
flat `upsamples` list for the published two residual blocks per level, so a VAE with another count
(the tiny models' one) gets wrong names from it. A decoder level is its `num_res_blocks + 1`
residual blocks, then (but for the last level) its upsampler. Wan 2.2's residual VAE has another
layout, which diffusers cannot read from one file either: refused.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

TOP = (("quant_conv.", "conv1."), ("post_quant_conv.", "conv2."), ("encoder.conv_in.", "encoder.conv1."),
       ("decoder.conv_in.", "decoder.conv1."), ("encoder.norm_out.", "encoder.head.0."),
       ("encoder.conv_out.", "encoder.head.2."), ("decoder.norm_out.", "decoder.head.0."),
       ("decoder.conv_out.", "decoder.head.2."), ("encoder.mid_block.attentions.0.", "encoder.middle.1."),
       ("decoder.mid_block.attentions.0.", "decoder.middle.1."))
RESIDUAL = (("norm1.", "residual.0."), ("conv1.", "residual.2."), ("norm2.", "residual.3."),
            ("conv2.", "residual.6."), ("conv_shortcut.", "shortcut."))


def _renamed(key: str, pairs: tuple[tuple[str, str], ...]) -> str | None:
    return next((original + key[len(part):] for part, original in pairs if key.startswith(part)), None)


def _residual(rest: str) -> str:
    return _renamed(rest, RESIDUAL) or rest


def original_name(key: str, res_blocks: int) -> str:
    """The original name of an AutoencoderKLWan (2.1) tensor, for `res_blocks` per level."""
    if (top := _renamed(key, TOP)) is not None:
        return top
    if m := re.fullmatch(r"(encoder|decoder)\.mid_block\.resnets\.(\d+)\.(.+)", key):
        return f"{m[1]}.middle.{2 * int(m[2])}.{_residual(m[3])}"
    if m := re.fullmatch(r"encoder\.down_blocks\.(\d+)\.(.+)", key):
        return f"encoder.downsamples.{m[1]}.{_residual(m[2])}"
    if m := re.fullmatch(r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", key):
        return f"decoder.upsamples.{int(m[1]) * (res_blocks + 2) + int(m[2])}.{_residual(m[3])}"
    if m := re.fullmatch(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.+)", key):
        return f"decoder.upsamples.{int(m[1]) * (res_blocks + 2) + res_blocks + 1}.{m[2]}"
    raise KeyError(f"{key} is not a tensor of Wan 2.1's VAE")


def wan21_vae(tensors: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """A Wan 2.1 VAE file's tensors in the names of the VAE `config` builds (KeyError for a tensor
    it has not)."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKLWan

    if config.get("is_residual"):
        raise ValueError("the base's VAE is Wan 2.2's, whose original layout diffusers does not convert:"
                         " give its diffusers vae folder")
    with init_empty_weights():
        names = AutoencoderKLWan.from_config(config).state_dict()
    diffusers_name = {original_name(name, config["num_res_blocks"]): name for name in names}
    return {diffusers_name[key]: value for key, value in tensors.items()}
