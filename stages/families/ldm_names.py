"""The original (LDM/SGM) module names of a diffusers UNet2DConditionModel: what A1111 and ComfyUI
checkpoints and LoRAs call SD1.x/2.x and SDXL's UNet layers (`input_blocks.1.1.transformer_blocks.0
.attn1.to_q`, `input_blocks.1.0.emb_layers.1`, `time_embed.0`, `label_emb.0.0`).

Written by hand: diffusers keeps only the LDM -> diffusers direction (its single-file converter walks
the keys a checkpoint has, so it cannot be probed the way the transformer families' converters are).
The table follows the block arithmetic of diffusers' `convert_ldm_unet_checkpoint` (each level holds
layers_per_block resnet (+ attention) blocks then a downsampler; each up level one more block); the
tests check it both ways: a checkpoint written with it loads through diffusers' single-file
converter (tests/test_single_file.py), and a LoRA written with it through diffusers' kohya/SGM LoRA
converter (tests/test_families_sd.py).
"""
from __future__ import annotations


from lorapipe.stages.lora_formats.original_names import OriginalNames, whole

TOP = (("time_embed.0.", "time_embedding.linear_1."), ("time_embed.2.", "time_embedding.linear_2."),
       ("input_blocks.0.0.", "conv_in."), ("out.0.", "conv_norm_out."), ("out.2.", "conv_out."),
       ("label_emb.0.0.", "add_embedding.linear_1."), ("label_emb.0.2.", "add_embedding.linear_2."))
RESNET = (("in_layers.0.", "norm1."), ("in_layers.2.", "conv1."), ("out_layers.0.", "norm2."),
          ("out_layers.3.", "conv2."), ("emb_layers.1.", "time_emb_proj."), ("skip_connection.", "conv_shortcut."))


def unet_block_prefixes(config: dict) -> list[tuple[str, str]]:
    """(LDM prefix, diffusers prefix) for every block of a UNet2DConditionModel."""
    levels, per = len(config["block_out_channels"]), config["layers_per_block"]
    pairs = [("middle_block.1.", "mid_block.attentions.0."), ("middle_block.0.", "mid_block.resnets.0."),
             ("middle_block.2.", "mid_block.resnets.1.")]
    for i in range(levels):
        down_attn = "CrossAttn" in config["down_block_types"][i]
        for j in range(per):
            pairs.append((f"input_blocks.{(per + 1) * i + j + 1}.0.", f"down_blocks.{i}.resnets.{j}."))
            if down_attn:
                pairs.append((f"input_blocks.{(per + 1) * i + j + 1}.1.", f"down_blocks.{i}.attentions.{j}."))
        up_attn = "CrossAttn" in config["up_block_types"][i]
        for j in range(per + 1):
            pairs.append((f"output_blocks.{(per + 1) * i + j}.0.", f"up_blocks.{i}.resnets.{j}."))
            if up_attn:
                pairs.append((f"output_blocks.{(per + 1) * i + j}.1.", f"up_blocks.{i}.attentions.{j}."))
        if i < levels - 1:
            pairs.append((f"input_blocks.{(per + 1) * (i + 1)}.0.op.", f"down_blocks.{i}.downsamplers.0.conv."))
            pairs.append((f"output_blocks.{(per + 1) * i + per}.{2 if up_attn else 1}.", f"up_blocks.{i}.upsamplers.0."))
    return pairs


def renamed(key: str, pairs) -> str | None:
    return next((ldm + key[len(hf):] for ldm, hf in pairs if key.startswith(hf)), None)


def ldm_name(key: str, blocks: list[tuple[str, str]]) -> str:
    """The LDM name of a diffusers UNet key (a parameter or a module name followed by '.')."""
    top = renamed(key, TOP)
    if top is not None:
        return top
    prefix = next((hf for _, hf in blocks if key.startswith(hf)), None)
    if prefix is None:
        raise KeyError(f"no LDM name for UNet key {key}")
    rest = key[len(prefix):]
    if ".resnets." in prefix:
        rest = renamed(rest, RESNET) or rest
    return renamed(prefix, blocks) + rest


def unet_original_names(config: dict, modules: list[str]) -> OriginalNames:
    """The LDM name of each of `modules` (diffusers UNet module names), one whole module each: the
    LDM UNet fuses none of the layers a LoRA adapts."""
    blocks = unet_block_prefixes(config)
    return {ldm_name(f"{m}.", blocks).removesuffix("."): (whole(m),) for m in modules}
