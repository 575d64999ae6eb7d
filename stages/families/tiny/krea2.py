"""A tiny Krea 2 built offline, byte-for-byte reproducible: `lorapipe tiny-model DIR --arch krea2`
(base) or `--arch krea2-distilled` (model_index.json's is_distilled).

Transformer: 2 blocks of 2 query heads and 1 key/value head of 16 (grouped-query attention, as the
full model's 48/12), rope axes (4, 6, 6), a text fusion of one layerwise and one refiner block over
3 tapped hidden states; text encoder: a Qwen3-VL with a 16-dim, 4-layer language model and a
1-layer vision tower around the shared tiny Qwen tokenizer, layers 1, 2 and 4 tapped (the
pipeline's `text_encoder_select_layers`, in model_index.json); VAE: Qwen-Image's video VAE as in
the tiny Qwen-Image (seeded per-channel statistics); scheduler with Krea 2's dynamic shift.
"""
from __future__ import annotations

from pathlib import Path

from .qwen import TEXT_DIM, qwen_tokenizer, seeded
from .qwenimage import Z_DIM, tiny_qwenimage_vae

SELECT_LAYERS = (1, 2, 4)


def _transformer():
    from diffusers import Krea2Transformer2DModel

    return Krea2Transformer2DModel(in_channels=4 * Z_DIM, num_layers=2, attention_head_dim=16, num_attention_heads=2,
                                   num_key_value_heads=1, intermediate_size=32, timestep_embed_dim=32,
                                   text_hidden_dim=TEXT_DIM, num_text_layers=len(SELECT_LAYERS),
                                   text_num_attention_heads=2, text_num_key_value_heads=2, text_intermediate_size=32,
                                   num_layerwise_text_blocks=1, num_refiner_text_blocks=1, axes_dims_rope=(4, 6, 6))


def tiny_qwen3_vl(tokenizer, layers: int = 4):
    """A Qwen3-VL with a 16-dim language model of `layers` layers and a 1-layer vision tower."""
    from transformers import Qwen3VLConfig, Qwen3VLModel

    ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
                   tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                                    "<|video_pad|>"])))
    config = Qwen3VLConfig(
        text_config={"hidden_size": TEXT_DIM, "intermediate_size": 32, "num_hidden_layers": layers,
                     "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": len(tokenizer),
                     "max_position_embeddings": 1024,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0,
                                         "mrope_section": [2, 1, 1], "mrope_interleaved": True}},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                       "out_hidden_size": TEXT_DIM,
                       "deepstack_visual_indexes": [0], "num_position_embeddings": 16},
        **ids,
    )
    return Qwen3VLModel(config).eval()


def build_tiny_krea2(out_dir: Path, distilled: bool = False) -> Path:
    from diffusers import FlowMatchEulerDiscreteScheduler, Krea2Pipeline

    tokenizer = qwen_tokenizer()
    pipe = Krea2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.5,
                                                  max_shift=1.15, base_image_seq_len=256, max_image_seq_len=6400,
                                                  time_shift_type="exponential"),
        vae=seeded(tiny_qwenimage_vae), text_encoder=seeded(tiny_qwen3_vl, tokenizer), tokenizer=tokenizer,
        transformer=seeded(_transformer), text_encoder_select_layers=SELECT_LAYERS,
        is_distilled=distilled,
    )
    pipe.save_pretrained(Path(out_dir), safe_serialization=True)
    return Path(out_dir)
