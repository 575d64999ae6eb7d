"""A tiny LTX-2 built offline, byte-for-byte reproducible: `lorapipe tiny-model DIR --arch ltx2` (or
`--arch ltx2-i2v`: the same components as an LTX2ImageToVideoPipeline).

Text: a Gemma 3 (conditional generation, a tiny SigLIP vision tower beside it) with hidden size 16
and 2 layers, around a byte-fallback BPE tokenizer trained on the bundled captions (words of the
demo images' and demo clips' captions; any other character falls back to bytes); the text
connectors with 8 learnable registers (the real model's replace padding with 128). Video VAE:
LTX-2's layout (4x4 pixel patches, then spatial, temporal and two spatio-temporal downsamplings:
32x spatial, 8x temporal) at widths 8 to 64 with 8 latent channels, its per-channel
latents_mean/latents_std buffers set to seeded values and its scaling_factor to 0.8 (zeros and ones
would hide a wrong normalisation); its decoder pads by reflection, so it renders sides of 64 px and
more. Transformer: 2 blocks, 2 heads of 8, its audio stream at width 8. Audio VAE and vocoder as
diffusers' own tiny test configs (the pipeline renders audio with every clip). Scheduler:
flow-matching Euler with LTX's resolution-dependent shift (0.95 at 1024 tokens to 2.05 at 4096)
and terminal sigma 0.1.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .qwen import CAPTIONS, seeded

TEXT_DIM = 16
TEXT_LAYERS = 2
LATENT_CHANNELS = 8
REGISTERS = 8  # the connectors' learnable registers: max_sequence_length must be a multiple
SCALING_FACTOR = 0.8  # LTX-2's VAE has 1.0, which would hide a normalisation that leaves it out
SCHEDULER = dict(use_dynamic_shifting=True, base_image_seq_len=1024, max_image_seq_len=4096, base_shift=0.95,
                 max_shift=2.05, shift_terminal=0.1)
GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")  # ids 0-4 as GemmaTokenizer numbers them


def gemma_tokenizer():
    """A GemmaTokenizer (byte-fallback BPE, spaces as "▁", <bos> first) whose merges join the
    letters of each word of the bundled captions: training exhausts them, so the files are
    byte-identical when rebuilt."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import GemmaTokenizer

    from lorapipe.stages.demo.clips import SCENES

    captions = [p.read_text().strip() for p in sorted(CAPTIONS.glob("*.txt"))]
    captions += [caption for *_, caption in SCENES]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = Tokenizer(models.BPE())
    trainer.normalizer = normalizers.Replace(" ", "▁")
    trainer.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_previous")
    trainer.train_from_iterator(captions, trainers.BpeTrainer(
        vocab_size=5000, special_tokens=[*GEMMA_SPECIALS, *byte_tokens], show_progress=False))
    model = json.loads(trainer.to_str())["model"]
    return GemmaTokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]], model_max_length=1024,
                          add_bos_token=True)


def _gemma3(vocab_size: int):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(vocab_size=vocab_size, hidden_size=TEXT_DIM, intermediate_size=32, num_hidden_layers=TEXT_LAYERS,
                num_attention_heads=2, num_key_value_heads=1, head_dim=8, query_pre_attn_scalar=8,
                sliding_window=64, max_position_embeddings=2048)
    vision = dict(model_type="siglip_vision_model", hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    return Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                                       boi_token_index=vocab_size, eoi_token_index=vocab_size + 1,
                                                       image_token_index=vocab_size + 2)).eval()


def _connectors():
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    stream = dict(num_attention_heads=2, attention_head_dim=8, num_layers=1, num_learnable_registers=REGISTERS)
    return LTX2TextConnectors(caption_channels=TEXT_DIM, text_proj_in_factor=TEXT_LAYERS + 1,
                              connector_rope_base_seq_len=1024,
                              **{f"{s}_connector_{k}": v for s in ("video", "audio") for k, v in stream.items()})


def _vae():
    from diffusers import AutoencoderKLLTX2Video

    vae = AutoencoderKLLTX2Video(
        latent_channels=LATENT_CHANNELS, block_out_channels=(8, 16, 32, 64), decoder_block_out_channels=(8, 16, 32),
        layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
        downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"), decoder_causal=False,
        spatial_compression_ratio=32, temporal_compression_ratio=8, scaling_factor=SCALING_FACTOR)
    generator = torch.Generator().manual_seed(1)
    vae.latents_mean.copy_(torch.randn(LATENT_CHANNELS, generator=generator) * 0.5)
    vae.latents_std.copy_(torch.rand(LATENT_CHANNELS, generator=generator) + 0.5)
    return vae


def _audio_vae():
    from diffusers import AutoencoderKLLTX2Audio

    return AutoencoderKLLTX2Audio(base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1,
                                  attn_resolutions=None, in_channels=2, resolution=32, latent_channels=2,
                                  norm_type="pixel", causality_axis="height", dropout=0.0,
                                  mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160,
                                  is_causal=True, mel_bins=8)


def _vocoder(audio_vae):
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    return LTX2Vocoder(in_channels=audio_vae.config.output_channels * audio_vae.config.mel_bins, hidden_channels=32,
                       out_channels=2, upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2],
                       resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]], leaky_relu_negative_slope=0.1,
                       output_sampling_rate=16000)


def _transformer(audio_channels: int):
    from diffusers import LTX2VideoTransformer3DModel

    return LTX2VideoTransformer3DModel(
        in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, audio_in_channels=audio_channels, audio_out_channels=audio_channels,
        audio_num_attention_heads=2, audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2,
        caption_channels=TEXT_DIM)


def build_tiny_ltx2(out_dir: Path, image_to_video: bool = False) -> Path:
    """Write a tiny LTX-2 into out_dir (`image_to_video`: the same components as an LTX2ImageToVideoPipeline)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2ImageToVideoPipeline, LTX2Pipeline

    tokenizer = gemma_tokenizer()
    audio_vae = seeded(_audio_vae)
    latent_mel_bins = audio_vae.config.mel_bins // audio_vae.mel_compression_ratio
    pipe = (LTX2ImageToVideoPipeline if image_to_video else LTX2Pipeline)(
        tokenizer=tokenizer, text_encoder=seeded(_gemma3, len(tokenizer)), connectors=seeded(_connectors),
        vae=seeded(_vae), audio_vae=audio_vae, vocoder=seeded(_vocoder, audio_vae),
        transformer=seeded(_transformer, audio_vae.config.latent_channels * latent_mel_bins),
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
    )
    pipe.save_pretrained(Path(out_dir), safe_serialization=True)
    return Path(out_dir)
