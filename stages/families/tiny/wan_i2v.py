"""A tiny Wan 2.1 I2V built offline, byte-for-byte reproducible: `lorapipe tiny-model DIR --arch wan2.1-i2v`,
a tiny Wan 2.2 I2V A14B: `--arch wan2.2-i2v-a14b`, or the tiny Wan 2.2 TI2V-5B (`wan2.2-5b`, the same
bytes) as an image-to-video pipeline: `--arch wan2.2-5b-i2v`.

The tiny Wan 2.1's text encoder, tokenizer, VAE and scheduler (the same bytes, as the real I2V
models share Wan 2.1's VAE and UMT5), a transformer that reads the noisy latents, the 4-channel
first-frame mask and the conditioning latents concatenated on channels (16 + 4 + 16 in), and the
CLIP-vision embedding of the image through its image embedder and added key/value projections;
a tiny CLIPVisionModel as the image encoder with its CLIPImageProcessor. The A14B has no image
encoder (its transformers read no image embedding) and a second transformer of other weights as
its low-noise expert, with the published boundary_ratio and sample shift.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .flux1 import t5_tokenizer
from .qwen import seeded
from .wan import FLOW_SHIFT, LOW_NOISE_SEED, TEXT_DIM, _umt5, _vae

IMAGE_DIM = 16  # the tiny CLIP vision model's hidden size: what the transformer's image embedder reads
IMAGE_SIZE = 32  # the CLIP image processor's input side
MASK_CHANNELS = 4  # the first-frame mask: one channel per frame the VAE packs into a latent frame
A14B_BOUNDARY_RATIO = 0.9  # Wan 2.2 I2V-A14B's: the high-noise expert denoises t >= 900 of 1000
A14B_FLOW_SHIFT = 5.0  # Wan 2.2 I2V-A14B's sample_shift


def _image_encoder():
    from transformers import CLIPVisionConfig, CLIPVisionModel

    return CLIPVisionModel(CLIPVisionConfig(hidden_size=IMAGE_DIM, intermediate_size=32, num_hidden_layers=2,
                                            num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=8)).eval()


def _image_processor():
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})


def _transformer(channels: int, reads_image: bool):
    from diffusers import WanTransformer3DModel

    heads, head_dim = 2, 12
    image = dict(image_dim=IMAGE_DIM, added_kv_proj_dim=heads * head_dim) if reads_image else {}
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim,
                                 in_channels=2 * channels + MASK_CHANNELS, out_channels=channels, text_dim=TEXT_DIM,
                                 freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                                 qk_norm="rms_norm_across_heads", rope_max_seq_len=32, **image)


def build_tiny_wan_i2v(out_dir: Path, experts: bool = False) -> Path:
    """Write a tiny Wan 2.1 I2V, with `experts` a tiny Wan 2.2 I2V A14B, into out_dir."""
    from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline

    tokenizer = t5_tokenizer()
    vae = seeded(_vae, False)
    if experts:
        torch.manual_seed(LOW_NOISE_SEED)
        parts = {"transformer_2": _transformer(vae.config.z_dim, False), "boundary_ratio": A14B_BOUNDARY_RATIO}
    else:
        parts = {"image_processor": _image_processor(), "image_encoder": seeded(_image_encoder)}
    pipe = WanImageToVideoPipeline(
        tokenizer=tokenizer, text_encoder=seeded(_umt5, len(tokenizer)), vae=vae,
        scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                          flow_shift=A14B_FLOW_SHIFT if experts else FLOW_SHIFT[False]),
        transformer=seeded(_transformer, vae.config.z_dim, not experts), **parts,
    )
    pipe.save_pretrained(Path(out_dir), safe_serialization=True)
    return Path(out_dir)


def build_tiny_ti2v_i2v(out_dir: Path) -> Path:
    """Write the tiny Wan 2.2 TI2V-5B (its components' bytes) as a WanImageToVideoPipeline into out_dir."""
    from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline

    from .wan import _transformer as t2v_transformer

    tokenizer = t5_tokenizer()
    vae = seeded(_vae, True)
    pipe = WanImageToVideoPipeline(
        tokenizer=tokenizer, text_encoder=seeded(_umt5, len(tokenizer)), vae=vae,
        scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                          flow_shift=FLOW_SHIFT[True]),
        transformer=seeded(t2v_transformer, vae.config.z_dim), expand_timesteps=True,
    )
    pipe.save_pretrained(Path(out_dir), safe_serialization=True)
    return Path(out_dir)
