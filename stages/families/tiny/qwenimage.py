"""A tiny Qwen-Image built offline, byte-for-byte reproducible: `lorapipe tiny-model DIR --arch
qwen-image`.

Transformer: 2 blocks, 3 heads of 16, rope axes (8, 4, 4) (diffusers' test config) on 4-channel
latents packed 2x2; text encoder: a Qwen2.5-VL with a 16-dim, 2-layer language model and a 2-layer
vision tower, around the shared tiny Qwen tokenizer; VAE: Qwen-Image's video VAE at 4 latent
channels and 8x spatial downsampling, its per-channel latents_mean/latents_std set to seeded values
(zeros and ones would hide a wrong normalisation).
"""
from __future__ import annotations

from pathlib import Path

import torch

from .qwen import TEXT_DIM, qwen_tokenizer, seeded

Z_DIM = 4
MAX_PIXELS = 64 * 28 * 28  # 64 merged patches of 28 x 28 pixels


def tiny_qwenimage_transformer():
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(patch_size=2, in_channels=4 * Z_DIM, out_channels=Z_DIM, num_layers=2,
                                       attention_head_dim=16, num_attention_heads=3, joint_attention_dim=TEXT_DIM,
                                       guidance_embeds=False, axes_dims_rope=(8, 4, 4))


def tiny_qwenimage_vae():
    from diffusers import AutoencoderKLQwenImage

    generator = torch.Generator().manual_seed(1)
    mean = (torch.randn(Z_DIM, generator=generator) * 0.5).tolist()
    std = (torch.rand(Z_DIM, generator=generator) + 0.5).tolist()
    return AutoencoderKLQwenImage(base_dim=Z_DIM * 6, z_dim=Z_DIM, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                                  temperal_downsample=[False, True, True], latents_mean=mean, latents_std=std)


def tiny_qwen25vl(tokenizer):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id",
                    "bos_token_id", "eos_token_id"),
                   tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                                    "<|video_pad|>", "<|endoftext|>", "<|im_end|>"])))
    config = Qwen2_5_VLConfig(
        text_config={"hidden_size": TEXT_DIM, "intermediate_size": 32, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": len(tokenizer),
                     "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
                     "rope_theta": 1000000.0, **ids},
        vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16},
        vocab_size=len(tokenizer), **ids,
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def vl_processor(tokenizer):
    """The processor that feeds the tiny Qwen2.5-VL images. transformers builds no Qwen2VLProcessor
    without torchvision (its video processor needs it, even for images), so it is a
    PaddleOCRVLProcessor: the same image-token expansion (one `<|image_pad|>` per merged 2x2 patch of
    `image_grid_thw`) around Qwen2-VL's image processor, built and loaded without torchvision. Its
    image processor reads at most 64 merged patches per image (the real one reads up to 16384), which
    keeps the tiny model fast. `tokenizer` must name `image_token` (qwen_tokenizer's named_tokens)."""
    from transformers import PaddleOCRVLProcessor, Qwen2VLImageProcessorPil

    return PaddleOCRVLProcessor(image_processor=Qwen2VLImageProcessorPil(max_pixels=MAX_PIXELS), tokenizer=tokenizer)


def tiny_qwenimage_parts(tokenizer) -> dict:
    """The components every tiny Qwen-Image pipeline shares (the edit pipelines add a processor)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return {
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.5,
                                                     max_shift=0.9, time_shift_type="exponential"),
        "vae": seeded(tiny_qwenimage_vae), "text_encoder": seeded(tiny_qwen25vl, tokenizer), "tokenizer": tokenizer,
        "transformer": seeded(tiny_qwenimage_transformer),
    }


def build_tiny_qwenimage(out_dir: Path) -> Path:
    from diffusers import QwenImagePipeline

    QwenImagePipeline(**tiny_qwenimage_parts(qwen_tokenizer())).save_pretrained(Path(out_dir), safe_serialization=True)
    return Path(out_dir)
