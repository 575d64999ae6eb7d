"""SD1.x/SDXL components written in the original (LDM) layout, A1111's names without their
checkpoint prefixes (the family's `checkpoint_prefixes` say which), and a whole A1111 checkpoint.

The UNet and VAE writers generalise the retired diffusers script
convert_diffusers_to_original_stable_diffusion.py to any number of levels and layers per block.
A whole checkpoint covers SD1.x (one CLIP text encoder); SDXL's second text encoder is stored in
OpenCLIP's layout, which nothing here writes.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from lorapipe.stages.families import Family
from lorapipe.stages.families.ldm_names import ldm_name, renamed, unet_block_prefixes

from . import folder_tensors


def unet_to_ldm(state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    blocks = unet_block_prefixes(config)
    return {ldm_name(key, blocks): value for key, value in state.items()}


def vae_to_ldm(state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    levels, per = len(config["block_out_channels"]), config["layers_per_block"]
    pairs = [("encoder.mid.attn_1.", "encoder.mid_block.attentions.0."), ("decoder.mid.attn_1.", "decoder.mid_block.attentions.0.")]
    for side in ("encoder", "decoder"):
        pairs += [(f"{side}.mid.block_{j + 1}.", f"{side}.mid_block.resnets.{j}.") for j in range(2)]
        pairs += [(f"{side}.norm_out.", f"{side}.conv_norm_out.")]
    for i in range(levels):
        pairs += [(f"encoder.down.{i}.block.{j}.", f"encoder.down_blocks.{i}.resnets.{j}.") for j in range(per)]
        pairs += [(f"decoder.up.{levels - 1 - i}.block.{j}.", f"decoder.up_blocks.{i}.resnets.{j}.") for j in range(per + 1)]
        if i < levels - 1:
            pairs += [(f"encoder.down.{i}.downsample.", f"encoder.down_blocks.{i}.downsamplers.0."),
                      (f"decoder.up.{levels - 1 - i}.upsample.", f"decoder.up_blocks.{i}.upsamplers.0.")]
    parts = [("nin_shortcut.", "conv_shortcut."), ("norm.", "group_norm."), ("q.", "to_q."), ("k.", "to_k."),
             ("v.", "to_v."), ("proj_out.", "to_out.0.")]
    out = {}
    for key, value in state.items():
        new = key
        for ldm, hf in pairs:
            if key.startswith(hf):
                rest = key[len(hf):]
                new = ldm + (renamed(rest, parts) or rest)
                if ".attn_1." in ldm and rest.split(".")[0].startswith(("to_", "proj")) and value.ndim == 2:
                    value = value[:, :, None, None]
                break
        out[new] = value
    return out


def text_to_ldm(state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """CLIP in A1111's names: transformers' older ones, under `text_model.`."""
    return {"text_model." + k.removeprefix("text_model."): v for k, v in state.items() if not k.endswith("position_ids")}


LDM_WRITERS = {"unet": unet_to_ldm, "vae": vae_to_ldm, "text_encoder": text_to_ldm}


def ldm_component(model_dir: Path, component: str) -> dict[str, torch.Tensor]:
    """A tiny folder's UNet, AutoencoderKL (SD's, or Flux.1's: BFL's ae.safetensors is in LDM names
    too) or CLIP text encoder in LDM names, without A1111's prefix for it."""
    config = json.loads((model_dir / component / "config.json").read_text())
    return LDM_WRITERS[component](folder_tensors(model_dir, component), config)


def write_ldm_checkpoint(model_dir: Path, path: Path, family: Family) -> Path:
    """A tiny SD1.x diffusers folder as one A1111-style `.safetensors` file."""
    tensors = {family.checkpoint_prefixes[c] + k: v for c in LDM_WRITERS for k, v in ldm_component(model_dir, c).items()}
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    return path
