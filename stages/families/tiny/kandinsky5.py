"""A tiny Kandinsky 5 text-to-image model built offline, byte-for-byte reproducible: `lorapipe
tiny-model DIR --arch kandinsky5`.

Transformer: 1 text block and 2 visual blocks, 2 heads of 16, rope axes (4, 6, 6), patches 1x2x2 on
16 latent channels; its modulation layers, which diffusers initialises to zero (every block's gates
shut, its attention's gradient zero), drawn at random like every other weight. Text encoders: the
tiny Qwen-Image Qwen2.5-VL (16-dim hidden states) around the shared tiny Qwen tokenizer in the
processor the pipeline calls with `text=`, and the tiny CLIP (pooled dim 32); VAE: the tiny Flux.1
one (16 channels, 8x downsampling, Flux.1's scale and a shift the pipeline ignores). Scheduler:
flow-match Euler at a static shift. The text-to-video model (`--arch kandinsky5-video`): the same text
encoders, the transformer reading a visual condition, HunyuanVideo's 3-D VAE (4x temporal); its
image-to-video model (`--arch kandinsky5-i2v`) holds the same weights.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from .clip import TEXT_DIM as POOLED_DIM, clip_text_encoder, write_tokenizer
from .flux1 import vae
from .qwen import TEXT_DIM, qwen_tokenizer, seeded
from .qwenimage import tiny_qwen25vl, vl_processor

SHIFT = 3.0


def _transformer(visual_cond: bool = False):
    from diffusers import Kandinsky5Transformer3DModel
    from diffusers.models.transformers.transformer_kandinsky import Kandinsky5Modulation

    transformer = Kandinsky5Transformer3DModel(
        in_visual_dim=16, out_visual_dim=16, in_text_dim=TEXT_DIM, in_text_dim2=POOLED_DIM, time_dim=32,
        patch_size=(1, 2, 2), model_dim=32, ff_dim=64, num_text_blocks=1, num_visual_blocks=2, axes_dims=(4, 6, 6),
        visual_cond=visual_cond)
    with torch.no_grad():
        for module in transformer.modules():
            if isinstance(module, Kandinsky5Modulation):
                module.out_layer.weight.normal_(std=0.1)
                module.out_layer.bias.normal_(std=0.1)
    return transformer


def _video_vae():
    from diffusers import AutoencoderKLHunyuanVideo

    return AutoencoderKLHunyuanVideo(latent_channels=16, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
                                     norm_num_groups=4, spatial_compression_ratio=8, temporal_compression_ratio=4)


def _build(out_dir: Path, pipeline_class: str, vae, transformer) -> Path:
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler

    out_dir = Path(out_dir)
    tokenizer = qwen_tokenizer({"image_token": "<|image_pad|>"})
    pipe = getattr(diffusers, pipeline_class)(
        transformer=transformer, vae=vae, text_encoder=seeded(tiny_qwen25vl, tokenizer),
        tokenizer=vl_processor(tokenizer), text_encoder_2=clip_text_encoder(False),
        tokenizer_2=write_tokenizer(out_dir / ".tokenizer-src"), scheduler=FlowMatchEulerDiscreteScheduler(shift=SHIFT))
    pipe.save_pretrained(out_dir, safe_serialization=True)
    shutil.rmtree(out_dir / ".tokenizer-src")
    return out_dir


def build_tiny_kandinsky5(out_dir: Path) -> Path:
    """Write a tiny Kandinsky 5 text-to-image model into out_dir."""
    return _build(out_dir, "Kandinsky5T2IPipeline", vae(), seeded(_transformer))


def build_tiny_kandinsky5_video(out_dir: Path, pipeline_class: str = "Kandinsky5T2VPipeline") -> Path:
    """Write a tiny Kandinsky 5 video model into out_dir (text-to-video, or `Kandinsky5I2VPipeline`'s
    image-to-video: the same weights): the image model's text encoders, its transformer reading a
    visual condition, HunyuanVideo's VAE at 16 channels."""
    return _build(out_dir, pipeline_class, seeded(_video_vae), seeded(_transformer, visual_cond=True))
