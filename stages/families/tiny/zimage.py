"""A tiny Z-Image built offline, byte-for-byte reproducible: `lorapipe tiny-model DIR --arch z-image`
(base, scheduler shift 6.0) or `--arch z-image-turbo` (shift 3.0, as the real Turbo's config).

Transformer: diffusers' own test config (dim 32, 2 layers and 1 refiner layer of each kind, 2 heads,
rope axes (8, 4, 4)) reading 16-dim caption features; text encoder: the shared tiny Qwen3
(qwen.py) with its tokenizer; VAE: tiny Flux.1's (16 channels, Flux.1's shift and scale).
"""
from __future__ import annotations

from pathlib import Path

from .flux1 import vae
from .qwen import TEXT_DIM, qwen3_config, qwen_tokenizer, seeded

SHIFT = {False: 6.0, True: 3.0}  # the real base's and Turbo's scheduler_config.json


def _transformer():
    from diffusers import ZImageTransformer2DModel

    return ZImageTransformer2DModel(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2,
                                    n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=TEXT_DIM,
                                    axes_dims=[8, 4, 4], axes_lens=[1024, 32, 32])


def build_tiny_zimage(out_dir: Path, turbo: bool = False) -> Path:
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline
    from transformers import Qwen3Model

    tokenizer = qwen_tokenizer()
    pipe = ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=SHIFT[turbo], use_dynamic_shifting=False), vae=vae(),
        text_encoder=seeded(Qwen3Model, qwen3_config(len(tokenizer))), tokenizer=tokenizer,
        transformer=seeded(_transformer),
    )
    pipe.save_pretrained(Path(out_dir), safe_serialization=True)
    return Path(out_dir)
