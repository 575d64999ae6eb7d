"""A tiny Wan built offline, byte-for-byte reproducible: `lorapipe tiny-model DIR --arch wan2.1` (T2V),
`--arch wan2.2-5b` (TI2V-5B) or `--arch wan2.2-a14b` (T2V A14B: two experts).

Transformer: 2 blocks, 2 heads of 12, patches (1, 2, 2), on the VAE's latent channels; text encoder:
a UMT5 with d_model 32 around the tiny Flux.1's Unigram T5 tokenizer (trained offline on the bundled
captions); VAE: Wan's 3-D VAE at base width 4, 4x temporal and 8x spatial downsampling with 16
latent channels (2.1), or 2.2's residual VAE that patchifies pixels 2x2 first, 16x spatial, 48
channels (5B); per-channel latents_mean/latents_std set to seeded values (zeros and ones would hide
a wrong normalisation). Scheduler: UniPC with flow sigmas at the published flow_shift (2.1: 3.0,
TI2V-5B: 5.0); the 5B pipeline expands timesteps per token, as its model_index.json says. A14B is
Wan 2.1's tiny model (the same text encoder and VAE bytes, so encode records are shared) with a
second transformer of other weights as its low-noise expert, `boundary_ratio` 0.875 in the
pipeline's config and the original T2V-A14B's sample shift 12.0.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .flux1 import t5_tokenizer
from .qwen import seeded

TEXT_DIM = 32
FLOW_SHIFT = {False: 3.0, True: 5.0}  # Wan2.1-T2V-1.3B's and Wan2.2-TI2V-5B's scheduler flow_shift
A14B_FLOW_SHIFT = 12.0  # Wan 2.2 T2V-A14B's sample_shift
A14B_BOUNDARY_RATIO = 0.875  # Wan 2.2 T2V-A14B's: the high-noise expert denoises t >= 875 of 1000
LOW_NOISE_SEED = 1  # the low-noise expert's weights differ from the high-noise one's


def _umt5(vocab_size: int):
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(UMT5Config(
        vocab_size=vocab_size, d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )).eval()


def _vae(ti2v: bool):
    from diffusers import AutoencoderKLWan

    z_dim = 48 if ti2v else 16
    generator = torch.Generator().manual_seed(1)
    mean = (torch.randn(z_dim, generator=generator) * 0.5).tolist()
    std = (torch.rand(z_dim, generator=generator) + 0.5).tolist()
    layout = dict(is_residual=True, patch_size=2, in_channels=12, out_channels=12, scale_factor_spatial=16) \
        if ti2v else {}
    return AutoencoderKLWan(base_dim=4, z_dim=z_dim, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True], latents_mean=mean, latents_std=std, **layout)


def _transformer(channels: int):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                 in_channels=channels, out_channels=channels, text_dim=TEXT_DIM, freq_dim=256,
                                 ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                 rope_max_seq_len=32)


def build_tiny_wan(out_dir: Path, ti2v: bool = False, experts: bool = False) -> Path:
    """Write a tiny Wan 2.1 T2V, with `ti2v` a tiny Wan 2.2 TI2V-5B, with `experts` a tiny Wan 2.2
    T2V-A14B, into out_dir."""
    from diffusers import UniPCMultistepScheduler, WanPipeline

    tokenizer = t5_tokenizer()
    vae = seeded(_vae, ti2v)
    two_experts = {}
    if experts:
        torch.manual_seed(LOW_NOISE_SEED)
        two_experts = {"transformer_2": _transformer(vae.config.z_dim), "boundary_ratio": A14B_BOUNDARY_RATIO}
    pipe = WanPipeline(
        tokenizer=tokenizer, text_encoder=seeded(_umt5, len(tokenizer)), vae=vae,
        scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                          flow_shift=A14B_FLOW_SHIFT if experts else FLOW_SHIFT[ti2v]),
        transformer=seeded(_transformer, vae.config.z_dim), expand_timesteps=ti2v, **two_experts,
    )
    pipe.save_pretrained(Path(out_dir), safe_serialization=True)
    return Path(out_dir)
