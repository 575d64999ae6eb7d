"""A tiny HunyuanImage 2.1 model built offline, byte-for-byte reproducible.

Transformer: 2 double-stream and 2 single-stream blocks (and 1 token-refiner block), 2 heads of 8,
rope axes (4, 4), patches 1x1 as the published one, on 4 latent channels; text encoders: the tiny
Qwen2.5-VL language model and ByT5 encoder of HunyuanVideo 1.5's tiny model (the pipeline reads the
third hidden state from the end and, for quoted text, ByT5's states); VAE: HunyuanImage 2.1's VAE at
width 32 (its group norms' 32 groups) with 4 latent channels and 32x downsampling, as the published
one. Scheduler: flow-match Euler; guider: adaptive projected mix guidance.
"""
from __future__ import annotations

from pathlib import Path

from .hunyuanvideo15 import GLYPH_DIM, text_components
from .qwen import TEXT_DIM, seeded

LATENT_CHANNELS = 4
SHIFT = 5.0
GUIDANCE_SCALE = 3.5
SCALING_FACTOR = 0.75  # the published VAE's is 0.75289


def _vae():
    from diffusers import AutoencoderKLHunyuanImage

    return AutoencoderKLHunyuanImage(in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS,
                                     block_out_channels=(32,) * 6, layers_per_block=1, spatial_compression_ratio=32,
                                     sample_size=64, scaling_factor=SCALING_FACTOR)


def _transformer():
    from diffusers import HunyuanImageTransformer2DModel

    return HunyuanImageTransformer2DModel(
        in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, num_attention_heads=2, attention_head_dim=8,
        num_layers=2, num_single_layers=2, num_refiner_layers=1, patch_size=(1, 1), text_embed_dim=TEXT_DIM,
        text_embed_2_dim=GLYPH_DIM, rope_axes_dim=(4, 4))


def build_tiny_hunyuanimage21(out_dir: Path) -> Path:
    """Write a tiny HunyuanImage 2.1 model into out_dir."""
    from diffusers import AdaptiveProjectedMixGuidance, FlowMatchEulerDiscreteScheduler, HunyuanImagePipeline

    pipe = HunyuanImagePipeline(
        **text_components(), vae=seeded(_vae), transformer=seeded(_transformer), scheduler=FlowMatchEulerDiscreteScheduler(shift=SHIFT),
        guider=AdaptiveProjectedMixGuidance(guidance_scale=GUIDANCE_SCALE),
    )
    pipe.save_pretrained(Path(out_dir), safe_serialization=True)
    return Path(out_dir)
