"""A tiny Wan 2.1 I2V built offline, byte-for-byte reproducible: `lorapipe tiny-model DIR --arch wan2.1-i2v`.

The tiny Wan 2.1's text encoder, tokenizer, VAE and scheduler (the same bytes, as the real I2V
models share Wan 2.1's VAE and UMT5), a transformer that reads the noisy latents, the 4-channel
first-frame mask and the conditioning latents concatenated on channels (16 + 4 + 16 in), and the
CLIP-vision embedding of the image through its image embedder and added key/value projections;
a tiny CLIPVisionModel as the image encoder with its CLIPImageProcessor.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .flux1 import t5_tokenizer
from .qwen import seeded
from .wan import FLOW_SHIFT, TEXT_DIM, _umt5, _vae

IMAGE_DIM = 16  # the tiny CLIP vision model's hidden size: what the transformer's image embedder reads
IMAGE_SIZE = 32  # the CLIP image processor's input side
MASK_CHANNELS = 4  # the first-frame mask: one channel per frame the VAE packs into a latent frame


def _image_encoder():
    from transformers import CLIPVisionConfig, CLIPVisionModel

    return CLIPVisionModel(CLIPVisionConfig(hidden_size=IMAGE_DIM, intermediate_size=32, num_hidden_layers=2,
                                            num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=8)).eval()


def _image_processor():
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})


def _transformer(channels: int):
    from diffusers import WanTransformer3DModel

    heads, head_dim = 2, 12
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim,
                                 in_channels=2 * channels + MASK_CHANNELS, out_channels=channels, text_dim=TEXT_DIM,
                                 freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                                 qk_norm="rms_norm_across_heads", rope_max_seq_len=32, image_dim=IMAGE_DIM,
                                 added_kv_proj_dim=heads * head_dim)


def build_tiny_wan_i2v(out_dir: Path) -> Path:
    """Write a tiny Wan 2.1 I2V into out_dir."""
    from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline

    tokenizer = t5_tokenizer()
    vae = seeded(_vae, False)
    pipe = WanImageToVideoPipeline(
        tokenizer=tokenizer, text_encoder=seeded(_umt5, len(tokenizer)), vae=vae,
        scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                          flow_shift=FLOW_SHIFT[False]),
        image_processor=_image_processor(), image_encoder=seeded(_image_encoder),
        transformer=seeded(_transformer, vae.config.z_dim),
    )
    pipe.save_pretrained(Path(out_dir), safe_serialization=True)
    return Path(out_dir)
