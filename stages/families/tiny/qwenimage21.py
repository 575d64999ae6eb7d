"""A tiny Qwen-Image 2.1 built offline, byte-for-byte reproducible: `lorapipe tiny-model DIR --arch
qwen-image-2.1`.

Transformer: 2 single-stream blocks, 3 heads of 16, rope axes (8, 4, 4) on 4-channel latents read
unpatched; text encoder: a Qwen3-VL with a 16-dim, 2-layer language model and a 1-layer vision
tower, its final norm's weights seeded (the pipeline reads the states before it), in a processor
around the shared tiny Qwen tokenizer whose chat template renders the system message whose token
count the pipeline drops (a LlavaProcessor: transformers builds no Qwen3VLProcessor without
torchvision, and text-to-image reads only the tokenizer); VAE: Qwen-Image 2.1's at 4 latent channels
and 16x spatial downsampling, its per-channel latents_mean/latents_std set to seeded values (zeros
and ones would hide a wrong normalisation).
"""
from __future__ import annotations

from pathlib import Path

import torch

from .qwen import TEXT_DIM, qwen_tokenizer, seeded

Z_DIM = 4
# renders what Qwen3-VL's own template renders for text-only messages, plain or as content parts
PROCESSOR_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}{{- part['text'] }}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _transformer():
    from diffusers import QwenImage21Transformer2DModel

    return QwenImage21Transformer2DModel(in_channels=Z_DIM, out_channels=Z_DIM, num_layers=2, attention_head_dim=16,
                                         num_attention_heads=3, context_in_dim=TEXT_DIM, axes_dims_rope=(8, 4, 4))


def _vae():
    from diffusers import AutoencoderKLQwenImage21

    generator = torch.Generator().manual_seed(1)
    mean = (torch.randn(Z_DIM, generator=generator) * 0.5).tolist()
    std = (torch.rand(Z_DIM, generator=generator) + 0.5).tolist()
    return AutoencoderKLQwenImage21(base_dim=8, decoder_base_dim=8, z_dim=Z_DIM, dim_mult=[1, 2, 2, 2, 2],
                                    num_res_blocks=1, temperal_downsample=[False, False, False, False],
                                    in_channels=3, out_channels=3, latents_mean=mean, latents_std=std)


def _text_encoder(tokenizer, layers: int = 2):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
                   tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                                    "<|video_pad|>"])))
    config = Qwen3VLConfig(
        text_config={"hidden_size": TEXT_DIM, "intermediate_size": 32, "num_hidden_layers": layers, "head_dim": 8,
                     "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": len(tokenizer),
                     "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0,
                                         "mrope_section": [2, 1, 1], "mrope_interleaved": True}},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                       "out_hidden_size": TEXT_DIM, "num_position_embeddings": 64, "deepstack_visual_indexes": [0]},
        **ids,
    )
    encoder = Qwen3VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # all ones would make the final norm invisible behind the transformer's own text norm
        encoder.model.language_model.norm.weight.uniform_(0.5, 1.5)
    return encoder


def _processor(tokenizer):
    from transformers import LlavaProcessor, Qwen2VLImageProcessorPil

    return LlavaProcessor(image_processor=Qwen2VLImageProcessorPil(patch_size=16), tokenizer=tokenizer,
                          chat_template=PROCESSOR_CHAT_TEMPLATE, image_token="<|image_pad|>")


def build_tiny_qwenimage21(out_dir: Path) -> Path:
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline

    tokenizer = qwen_tokenizer()
    pipe = QwenImage21Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.5,
                                                  max_shift=0.9, time_shift_type="exponential"),
        vae=seeded(_vae), text_encoder=seeded(_text_encoder, tokenizer), processor=_processor(tokenizer),
        transformer=seeded(_transformer),
    )
    pipe.save_pretrained(Path(out_dir), safe_serialization=True)
    return Path(out_dir)
