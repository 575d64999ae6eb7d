"""Tiny Stable Diffusion models built offline from configs, byte-for-byte reproducible:
`lorapipe tiny-model DIR --arch sd15|sdxl`.

Random weights from a fixed seed and a byte-level CLIP tokenizer written from scratch (also the
tiny Flux.1's CLIP and the benchmarks' full-size models use it), saved in the diffusers folder
layout, so they load through exactly the code path a real model does.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

SEED = 0
TEXT_DIM = 32


def _byte_level_vocab() -> dict[str, int]:
    """CLIP's byte-to-unicode alphabet, each symbol alone and word-final, plus the specials."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            codes.append(256 + extra)
            extra += 1
    symbols = [chr(c) for c in codes]
    tokens = symbols + [s + "</w>" for s in symbols] + ["<|startoftext|>", "<|endoftext|>"]
    return {tok: i for i, tok in enumerate(tokens)}


def write_tokenizer(out_dir: Path):
    from transformers import CLIPTokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "vocab.json").write_text(json.dumps(_byte_level_vocab(), ensure_ascii=False))
    (out_dir / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(out_dir / "vocab.json"), str(out_dir / "merges.txt"), model_max_length=77)
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def clip_text_encoder(with_projection: bool):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        hidden_size=TEXT_DIM, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2,
        vocab_size=len(_byte_level_vocab()), max_position_embeddings=77, projection_dim=TEXT_DIM,
        bos_token_id=len(_byte_level_vocab()) - 2, eos_token_id=len(_byte_level_vocab()) - 1,
        pad_token_id=len(_byte_level_vocab()) - 1,
    )
    torch.manual_seed(SEED)
    return (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(config)


def _vae():
    from diffusers import AutoencoderKL

    torch.manual_seed(SEED)
    return AutoencoderKL(  # four levels: 8x downsampling, like SD
        in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=8, sample_size=64,
        block_out_channels=(8, 16, 32, 32), layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
    )


def _unet(sdxl: bool):
    from diffusers import UNet2DConditionModel

    extra = {}
    cross_dim = TEXT_DIM
    if sdxl:
        cross_dim = 2 * TEXT_DIM  # both encoders' hidden states, concatenated
        extra = dict(
            addition_embed_type="text_time", addition_time_embed_dim=8,
            projection_class_embeddings_input_dim=TEXT_DIM + 6 * 8,
        )
    torch.manual_seed(SEED)
    # cross-attention only on the downsampled level: attention at full latent size is slow on CPU
    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, norm_num_groups=8,
        block_out_channels=(32, 64), attention_head_dim=8, cross_attention_dim=cross_dim,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), **extra,
    )


def _scheduler():
    from diffusers import DDPMScheduler

    return DDPMScheduler(
        num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085,
        beta_end=0.012, clip_sample=False, steps_offset=1,
    )


def build_tiny_sd(out_dir: Path, sdxl: bool) -> Path:
    """Write a tiny diffusers-format SD1.x (or SDXL) model into `out_dir`."""
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    out_dir = Path(out_dir)
    tokenizer = write_tokenizer(out_dir / ".tokenizer-src")
    if sdxl:
        pipe = StableDiffusionXLPipeline(
            vae=_vae(), text_encoder=clip_text_encoder(False), text_encoder_2=clip_text_encoder(True),
            tokenizer=tokenizer, tokenizer_2=tokenizer, unet=_unet(True), scheduler=_scheduler(),
        )
    else:
        pipe = StableDiffusionPipeline(
            vae=_vae(), text_encoder=clip_text_encoder(False), tokenizer=tokenizer, unet=_unet(False),
            scheduler=_scheduler(), safety_checker=None, feature_extractor=None,
            requires_safety_checker=False,
        )
    pipe.save_pretrained(out_dir, safe_serialization=True)
    shutil.rmtree(out_dir / ".tokenizer-src")
    return out_dir
