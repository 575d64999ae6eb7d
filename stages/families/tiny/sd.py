"""Tiny Stable Diffusion models built offline from configs, byte-for-byte reproducible:
`lorapipe tiny-model DIR --arch sd15|sdxl`.

Random weights from a fixed seed and the tiny byte-level CLIP (clip.py), saved in the diffusers
folder layout, so they load through exactly the code path a real model does.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from .clip import TEXT_DIM, clip_text_encoder, write_tokenizer

SEED = 0


def _vae():
    from diffusers import AutoencoderKL

    torch.manual_seed(SEED)
    return AutoencoderKL(  # four levels: 8x downsampling, like SD
        in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=8, sample_size=64,
        block_out_channels=(8, 16, 32, 32), layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
    )


def _unet(sdxl: bool):
    from diffusers import UNet2DConditionModel

    extra = {}
    cross_dim = TEXT_DIM
    if sdxl:
        cross_dim = 2 * TEXT_DIM  # both encoders' hidden states, concatenated
        extra = dict(
            addition_embed_type="text_time", addition_time_embed_dim=8,
            projection_class_embeddings_input_dim=TEXT_DIM + 6 * 8,
        )
    torch.manual_seed(SEED)
    # cross-attention only on the downsampled level: attention at full latent size is slow on CPU
    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, norm_num_groups=8,
        block_out_channels=(32, 64), attention_head_dim=8, cross_attention_dim=cross_dim,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), **extra,
    )


def _scheduler():
    from diffusers import DDPMScheduler

    return DDPMScheduler(
        num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085,
        beta_end=0.012, clip_sample=False, steps_offset=1,
    )


def build_tiny_sd(out_dir: Path, sdxl: bool) -> Path:
    """Write a tiny diffusers-format SD1.x (or SDXL) model into `out_dir`."""
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    out_dir = Path(out_dir)
    tokenizer = write_tokenizer(out_dir / ".tokenizer-src")
    if sdxl:
        pipe = StableDiffusionXLPipeline(
            vae=_vae(), text_encoder=clip_text_encoder(False), text_encoder_2=clip_text_encoder(True),
            tokenizer=tokenizer, tokenizer_2=tokenizer, unet=_unet(True), scheduler=_scheduler(),
        )
    else:
        pipe = StableDiffusionPipeline(
            vae=_vae(), text_encoder=clip_text_encoder(False), tokenizer=tokenizer, unet=_unet(False),
            scheduler=_scheduler(), safety_checker=None, feature_extractor=None,
            requires_safety_checker=False,
        )
    pipe.save_pretrained(out_dir, safe_serialization=True)
    shutil.rmtree(out_dir / ".tokenizer-src")
    return out_dir
