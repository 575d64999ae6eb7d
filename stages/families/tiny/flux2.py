"""A tiny Flux.2-klein built offline, byte-for-byte reproducible: `lorapipe tiny-model DIR --arch
flux2-klein` (base) or `--arch flux2-klein-distilled` (model_index.json's is_distilled).

Transformer: 1 double + 1 single block, 2 heads of 16, rope axes (4, 4, 4, 4), reading the 3 x 16
stacked hidden states of the shared tiny Qwen3 (28 layers, so that layers 9, 18 and 27 exist); VAE:
8 latent channels at 8x downsampling, patchified to 32, its batch-norm running statistics set to
seeded values (a fresh BatchNorm's 0 and 1 would hide a wrong normalisation); scheduler with
dynamic shifting, as Flux.2's.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .qwen import TEXT_DIM, qwen3_config, qwen_tokenizer, seeded

LATENT_CHANNELS = 8


def transformer(guidance: bool = False):
    """Klein's tiny transformer; `guidance`: with the guidance input (Flux.2-dev's)."""
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(patch_size=1, in_channels=4 * LATENT_CHANNELS, num_layers=1, num_single_layers=1,
                                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=3 * TEXT_DIM,
                                   timestep_guidance_channels=256, axes_dims_rope=(4, 4, 4, 4),
                                   guidance_embeds=guidance)


def tiny_flux2_vae():
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(in_channels=3, out_channels=3, block_out_channels=(8, 16, 32, 32), layers_per_block=1,
                             latent_channels=LATENT_CHANNELS, norm_num_groups=8, sample_size=64,
                             use_quant_conv=False, use_post_quant_conv=False)
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.randn(vae.bn.running_mean.shape) * 0.1)
        vae.bn.running_var.copy_(torch.rand(vae.bn.running_var.shape) + 0.5)
    return vae


def build_tiny_flux2(out_dir: Path, distilled: bool = False) -> Path:
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
    from transformers import Qwen3ForCausalLM

    tokenizer = qwen_tokenizer()
    pipe = Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True), vae=seeded(tiny_flux2_vae),
        text_encoder=seeded(Qwen3ForCausalLM, qwen3_config(len(tokenizer))), tokenizer=tokenizer,
        transformer=seeded(transformer), is_distilled=distilled,
    )
    pipe.save_pretrained(Path(out_dir), safe_serialization=True)
    return Path(out_dir)
