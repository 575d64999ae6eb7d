"""A tiny HunyuanVideo 1.5 text-to-video model built offline, byte-for-byte reproducible.

Transformer: 2 blocks (and 1 token-refiner block), 2 heads of 12, rope axes (4, 4, 4), patches
1x1x1, on the 4 latent channels plus the pipeline's condition latents and mask (2 x 4 + 1 input
channels); text encoders: a Qwen2.5-VL language model with 16-dim hidden states and 3 layers (the
pipeline reads the third hidden state from the end: not the embeddings) around the shared tiny Qwen
tokenizer and its chat template, and a T5 encoder of d_model 16 around ByT5's tokenizer (bytes: it
needs no vocabulary); VAE: HunyuanVideo 1.5's 3-D VAE at width 8 with 4 latent channels, 16x
spatial and 4x temporal downsampling, as the published one. Scheduler: flow-match Euler; guider:
classifier-free guidance.
"""
from __future__ import annotations

from pathlib import Path

from .qwen import ENDOFTEXT, TEXT_DIM, qwen_tokenizer, seeded

LATENT_CHANNELS = 4
GLYPH_DIM = 16  # the ByT5 encoder's d_model, the transformer's text_embed_2_dim
IMAGE_DIM = 8  # the transformer's image_embed_dim (the pipeline feeds zeros of it in text-to-video)
TEXT_LAYERS = 3  # the pipeline reads hidden_states[-3]: with 3 layers, the first layer's output
SHIFT = 5.0
GUIDANCE_SCALE = 6.0


def _qwen25vl_text(tokenizer):
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    bos, eos = tokenizer.convert_tokens_to_ids([ENDOFTEXT, "<|im_end|>"])
    return Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        hidden_size=TEXT_DIM, intermediate_size=32, num_hidden_layers=TEXT_LAYERS, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=len(tokenizer), rope_theta=1000000.0, bos_token_id=bos, eos_token_id=eos,
        rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
    )).eval()


def _byt5(vocab_size: int):
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(vocab_size=vocab_size, d_model=GLYPH_DIM, d_kv=8, d_ff=32, num_layers=2,
                                   num_heads=2, relative_attention_num_buckets=8, feed_forward_proj="gated-gelu",
                                   tie_word_embeddings=False)).eval()


def _vae():
    from diffusers import AutoencoderKLHunyuanVideo15

    return AutoencoderKLHunyuanVideo15(latent_channels=LATENT_CHANNELS, block_out_channels=(8, 8, 8, 8, 8),
                                       layers_per_block=1)


def _transformer():
    from diffusers import HunyuanVideo15Transformer3DModel

    return HunyuanVideo15Transformer3DModel(
        in_channels=2 * LATENT_CHANNELS + 1, out_channels=LATENT_CHANNELS, num_attention_heads=2,
        attention_head_dim=12, num_layers=2, num_refiner_layers=1, text_embed_dim=TEXT_DIM,
        text_embed_2_dim=GLYPH_DIM, image_embed_dim=IMAGE_DIM, rope_axes_dim=(4, 4, 4), task_type="t2v")


def text_components() -> dict:
    """The tiny Qwen2.5-VL and ByT5 encoders and their tokenizers, by the Hunyuan pipelines' component names."""
    from transformers import ByT5Tokenizer

    tokenizer, glyph_tokenizer = qwen_tokenizer(), ByT5Tokenizer()
    return {"text_encoder": seeded(_qwen25vl_text, tokenizer), "tokenizer": tokenizer,
            "text_encoder_2": seeded(_byt5, len(glyph_tokenizer)), "tokenizer_2": glyph_tokenizer}


def build_tiny_hunyuanvideo15(out_dir: Path) -> Path:
    """Write a tiny HunyuanVideo 1.5 text-to-video model into out_dir."""
    from diffusers import ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline

    pipe = HunyuanVideo15Pipeline(
        **text_components(), vae=seeded(_vae), transformer=seeded(_transformer), scheduler=FlowMatchEulerDiscreteScheduler(shift=SHIFT),
        guider=ClassifierFreeGuidance(guidance_scale=GUIDANCE_SCALE),
    )
    pipe.save_pretrained(Path(out_dir), safe_serialization=True)
    return Path(out_dir)
