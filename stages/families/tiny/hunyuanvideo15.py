"""A tiny HunyuanVideo 1.5 text-to-video model built offline, byte-for-byte reproducible.

Transformer: 2 blocks (and 1 token-refiner block), 2 heads of 12, rope axes (4, 4, 4), patches
1x1x1, on the 4 latent channels plus the pipeline's condition latents and mask (2 x 4 + 1 input
channels); text encoders: a Qwen2.5-VL language model with 16-dim hidden states and 3 layers (the
pipeline reads the third hidden state from the end: not the embeddings) around the shared tiny Qwen
tokenizer and its chat template, and a T5 encoder of d_model 16 around ByT5's tokenizer (bytes: it
needs no vocabulary); VAE: HunyuanVideo 1.5's 3-D VAE at width 8 with 4 latent channels, 16x
spatial and 4x temporal downsampling, as the published one. Scheduler: flow-match Euler; guider:
classifier-free guidance. `--arch hunyuanvideo1.5-i2v`: the same components with an i2v transformer of
other weights (the same shapes: it reads the same channels) as a HunyuanVideo15ImageToVideoPipeline,
with a tiny SigLIP vision model (hidden size IMAGE_DIM) and its image processor; its target_size is
small, as the pipeline sizes a clip from it and the image's aspect ratio.
"""
from __future__ import annotations

from pathlib import Path

from .qwen import ENDOFTEXT, TEXT_DIM, qwen_tokenizer, seeded

LATENT_CHANNELS = 4
GLYPH_DIM = 16  # the ByT5 encoder's d_model, the transformer's text_embed_2_dim
IMAGE_DIM = 8  # the transformer's image_embed_dim (the pipeline feeds zeros of it in text-to-video)
IMAGE_SIZE = 32  # the SigLIP image processor's input side
I2V_SEED = 1  # the image-to-video transformer's: weights other than text-to-video's
TARGET_SIZE = 32  # the i2v transformer's target_size: the pipeline renders at its aspect bucket of this area
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


def _siglip():
    from transformers import SiglipVisionConfig, SiglipVisionModel

    return SiglipVisionModel(SiglipVisionConfig(hidden_size=IMAGE_DIM, intermediate_size=16, num_hidden_layers=2,
                                                num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=8)).eval()


def _transformer(task_type: str = "t2v", target_size: int = 640):
    from diffusers import HunyuanVideo15Transformer3DModel

    return HunyuanVideo15Transformer3DModel(
        in_channels=2 * LATENT_CHANNELS + 1, out_channels=LATENT_CHANNELS, num_attention_heads=2,
        attention_head_dim=12, num_layers=2, num_refiner_layers=1, text_embed_dim=TEXT_DIM,
        text_embed_2_dim=GLYPH_DIM, image_embed_dim=IMAGE_DIM, rope_axes_dim=(4, 4, 4), task_type=task_type,
        target_size=target_size)


def text_components() -> dict:
    """The tiny Qwen2.5-VL and ByT5 encoders and their tokenizers, by the Hunyuan pipelines' component names."""
    from transformers import ByT5Tokenizer

    tokenizer, glyph_tokenizer = qwen_tokenizer(), ByT5Tokenizer()
    return {"text_encoder": seeded(_qwen25vl_text, tokenizer), "tokenizer": tokenizer,
            "text_encoder_2": seeded(_byt5, len(glyph_tokenizer)), "tokenizer_2": glyph_tokenizer}


def build_tiny_hunyuanvideo15(out_dir: Path, image_to_video: bool = False) -> Path:
    """Write a tiny HunyuanVideo 1.5 text-to-video model, with image_to_video its image-to-video
    pipeline, into out_dir."""
    import torch
    from diffusers import ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline

    parts = dict(
        **text_components(), vae=seeded(_vae), scheduler=FlowMatchEulerDiscreteScheduler(shift=SHIFT),
        guider=ClassifierFreeGuidance(guidance_scale=GUIDANCE_SCALE),
    )
    if image_to_video:
        from diffusers import HunyuanVideo15ImageToVideoPipeline
        from transformers import SiglipImageProcessor

        torch.manual_seed(I2V_SEED)
        pipe = HunyuanVideo15ImageToVideoPipeline(
            transformer=_transformer("i2v", TARGET_SIZE), image_encoder=seeded(_siglip),
            feature_extractor=SiglipImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}), **parts)
    else:
        pipe = HunyuanVideo15Pipeline(transformer=seeded(_transformer), **parts)
    pipe.save_pretrained(Path(out_dir), safe_serialization=True)
    return Path(out_dir)
