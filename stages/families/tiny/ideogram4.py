"""A tiny Ideogram 4 built offline, byte-for-byte reproducible: `lorapipe tiny-model DIR --arch
ideogram4`.

Transformers (conditional and unconditional, seeded apart): 2 blocks of 2 heads of 16, MRoPE
sections (4, 2, 2), reading the 13 tapped hidden states of 16 values; text encoder: the tiny
Krea 2's Qwen3-VL with 36 language-model layers, so that the pipeline's fixed taps (0, 3, ..., 33,
35) exist, its tokenizer the shared tiny Qwen one with a chat template that reads Qwen3-VL's
list-of-parts messages, as the pipeline writes them; VAE: the tiny Flux.2's (8 channels, patched to
32, seeded batch-norm statistics); scheduler: flow matching without a shift (the pipeline sets
its own sigmas).
"""
from __future__ import annotations

from pathlib import Path

from .flux2 import LATENT_CHANNELS, tiny_flux2_vae
from .krea2 import tiny_qwen3_vl
from .qwen import SEED, TEXT_DIM, qwen_tokenizer, seeded

TAPPED_LAYERS = 13  # len(QWEN3_VL_ACTIVATION_LAYERS)
ENCODER_LAYERS = 36
CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for part in message.content %}{{- part.text }}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _transformer():
    from diffusers import Ideogram4Transformer2DModel

    return Ideogram4Transformer2DModel(in_channels=4 * LATENT_CHANNELS, num_layers=2, attention_head_dim=16,
                                       num_attention_heads=2, intermediate_size=32, adaln_dim=16,
                                       llm_features_dim=TAPPED_LAYERS * TEXT_DIM, mrope_section=(4, 2, 2))


def build_tiny_ideogram4(out_dir: Path) -> Path:
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, Ideogram4Pipeline

    tokenizer = qwen_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    text_encoder = seeded(tiny_qwen3_vl, tokenizer, ENCODER_LAYERS)
    transformer = seeded(_transformer)
    torch.manual_seed(SEED + 1)
    unconditional = _transformer()
    pipe = Ideogram4Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=seeded(tiny_flux2_vae),
                             text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer,
                             unconditional_transformer=unconditional)
    pipe.save_pretrained(Path(out_dir), safe_serialization=True)
    return Path(out_dir)
