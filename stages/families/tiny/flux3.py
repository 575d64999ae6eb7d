"""A tiny FLUX.3 built offline, written as diffusers ships FLUX.3: by ModularPipeline.save_pretrained,
a folder with modular_model_index.json whose entries point at the folder itself (so two builds
differ in that path, and in nothing else).

Transformer: 1 double + 1 single block, 2 heads of 16, rope axes (4, 4, 4, 4), reading the text
block's default hidden layers (`TEXT_LAYERS`) of a tiny Qwen3-VL deep enough to have them (Qwen-Image
2.1's, with more layers), concatenated per token, in its LlavaProcessor (read for its tokenizer and
chat template); VAE: the tiny Flux.2 one, batch-norm statistics seeded. The scheduler and guider
are not saved (ModularPipeline.save_pretrained saves no component the blocks create from a config,
so no FLUX.3 folder has them): the blocks create them from their defaults. The prompt upsampler is
left out.
"""
from __future__ import annotations

from pathlib import Path

from .flux2 import LATENT_CHANNELS, tiny_flux2_vae
from .qwen import TEXT_DIM, qwen_tokenizer, seeded
from .qwenimage21 import _processor, _text_encoder

TEXT_LAYERS = (4, 8, 12, 16, 20, 24, 28, 32)  # Flux3TextEncoderStep's default text_encoder_out_layers


def tiny_flux3_transformer():
    from diffusers import Flux3Transformer2DModel

    channels = 4 * LATENT_CHANNELS  # patchified 2x2
    return Flux3Transformer2DModel(in_channels=channels, cond_in_channels=channels, num_layers=1,
                                   num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                                   joint_attention_dim=TEXT_DIM * len(TEXT_LAYERS), axes_dims_rope=(4, 4, 4, 4))


def tiny_flux3_text_encoder(tokenizer):
    return _text_encoder(tokenizer, layers=max(TEXT_LAYERS))


def build_tiny_flux3(out_dir: Path) -> Path:
    from diffusers.modular_pipelines import Flux3AutoBlocks

    tokenizer = qwen_tokenizer()
    pipe = Flux3AutoBlocks().init_pipeline()
    pipe.update_components(text_encoder=seeded(tiny_flux3_text_encoder, tokenizer), tokenizer=_processor(tokenizer),
                           vae=seeded(tiny_flux2_vae), transformer=seeded(tiny_flux3_transformer))
    pipe.save_pretrained(str(Path(out_dir).absolute()), overwrite_modular_index=True)  # a str: diffusers splits it
    return Path(out_dir)
