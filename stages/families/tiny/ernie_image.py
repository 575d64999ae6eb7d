"""A tiny ERNIE-Image built offline, byte-for-byte reproducible: `lorapipe tiny-model DIR --arch ernie-image`.

Transformer: 2 shared-AdaLN layers of width 32, 2 heads of 16, rope axes (4, 6, 6), reading the
16-dim hidden states of a Mistral3Model (the tiny Flux.2-dev's config: a 31-layer Mistral language
model and a 1-layer Pixtral vision tower); its tokenizer is Flux.2-dev's, adding its `<s>` bos as
Mistral's tokenizer does. The transformer initialises its modulation and final projection to zero,
which would make every prediction zero: they are set to seeded values. VAE: the shared tiny Flux.2
VAE (batch-norm statistics seeded); scheduler: static shift 4.0, as the real scheduler_config.json.
No prompt enhancer (`pe`, `pe_tokenizer`: optional components).
"""
from __future__ import annotations

from pathlib import Path

import torch

from .flux2 import LATENT_CHANNELS, tiny_flux2_vae
from .flux2_dev import mistral3_config, mistral_tokenizer
from .qwen import TEXT_DIM, seeded

SHIFT = 4.0  # baidu/ERNIE-Image's scheduler_config.json (use_dynamic_shifting false)


def _transformer():
    from diffusers import ErnieImageTransformer2DModel

    model = ErnieImageTransformer2DModel(hidden_size=32, num_attention_heads=2, num_layers=2, ffn_hidden_size=64,
                                         in_channels=4 * LATENT_CHANNELS, out_channels=4 * LATENT_CHANNELS,
                                         text_in_dim=TEXT_DIM, rope_axes_dim=(4, 6, 6))
    with torch.no_grad():
        for zeroed in (model.adaLN_modulation[-1], model.final_linear):
            zeroed.weight.copy_(torch.randn(zeroed.weight.shape) * 0.1)
            zeroed.bias.copy_(torch.randn(zeroed.bias.shape) * 0.1)
    return model


def _tokenizer():
    tokenizer = mistral_tokenizer()
    tokenizer.add_bos_token = True
    tokenizer.update_post_processor()
    return tokenizer


def build_tiny_ernie_image(out_dir: Path) -> Path:
    from diffusers import ErnieImagePipeline, FlowMatchEulerDiscreteScheduler
    from transformers import Mistral3Model

    tokenizer = _tokenizer()
    pipe = ErnieImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=SHIFT, use_dynamic_shifting=False), vae=seeded(tiny_flux2_vae),
        text_encoder=seeded(Mistral3Model, mistral3_config(tokenizer)), tokenizer=tokenizer,
        transformer=seeded(_transformer),
    )
    pipe.save_pretrained(Path(out_dir), safe_serialization=True)
    return Path(out_dir)
