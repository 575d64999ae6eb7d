"""A tiny Chroma built offline, byte-for-byte reproducible: `lorapipe tiny-model DIR --arch chroma`.

Transformer: a ChromaTransformer2DModel of Flux.1's tiny shape (1 double + 1 single block, 2 heads of
16, joint dim 32, rope axes (4, 4, 8)) whose modulation comes from a 2-layer distilled-guidance
approximator of width 32; T5, its Unigram tokenizer and the VAE are Flux.1's tiny ones (tiny/flux1.py),
its scheduler Flux.1 dev's (dynamic shifting). Random weights from a fixed seed; saved as a
ChromaPipeline folder that `ChromaPipeline.from_pretrained` loads offline.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .flux1 import DEV_SCHEDULER, SEED, _t5, t5_tokenizer, vae


def _transformer():
    from diffusers import ChromaTransformer2DModel

    torch.manual_seed(SEED)
    return ChromaTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, axes_dims_rope=(4, 4, 8), approximator_num_channels=16, approximator_hidden_dim=32,
        approximator_layers=2,
    )


def build_tiny_chroma(out_dir: Path) -> Path:
    from diffusers import ChromaPipeline, FlowMatchEulerDiscreteScheduler

    tokenizer = t5_tokenizer()
    pipe = ChromaPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**DEV_SCHEDULER), vae=vae(),
                          text_encoder=_t5(len(tokenizer)), tokenizer=tokenizer, transformer=_transformer())
    pipe.save_pretrained(Path(out_dir), safe_serialization=True)
    return Path(out_dir)
