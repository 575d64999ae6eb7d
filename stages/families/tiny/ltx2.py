"""A tiny LTX-2 built offline, byte-for-byte reproducible: `lorapipe tiny-model DIR --arch ltx2` (or
`--arch ltx2-i2v`: the same components as an LTX2ImageToVideoPipeline; `--arch ltx2.5`: LTX-2.3's
transformer and connectors and a diffusion decoder, in an LTX25ModularPipeline folder).

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
VIDEO_WIDTH, AUDIO_WIDTH = 16, 8  # the transformer's streams: 2 heads of 8, 2 heads of 4
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


def _connectors(ltx23: bool = False):
    """LTX-2.0's connectors, or (`ltx23`) LTX-2.3's: gated attention and a projection per stream, to the
    transformer's widths (it then projects no caption itself)."""
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    stream = dict(num_attention_heads=2, attention_head_dim=8, num_layers=1, num_learnable_registers=REGISTERS)
    streams = {"video": stream, "audio": stream}
    ltx23_args = {}
    if ltx23:  # each connector at its stream's width
        streams["audio"] = {**stream, "attention_head_dim": AUDIO_WIDTH // 2}
        ltx23_args = dict(per_modality_projections=True, video_hidden_dim=VIDEO_WIDTH, audio_hidden_dim=AUDIO_WIDTH,
                          video_gated_attn=True, audio_gated_attn=True)
    return LTX2TextConnectors(caption_channels=TEXT_DIM, text_proj_in_factor=TEXT_LAYERS + 1,
                              connector_rope_base_seq_len=1024, **ltx23_args,
                              **{f"{s}_connector_{k}": v for s, args in streams.items() for k, v in args.items()})


def _latent_statistics() -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded per-channel latents_mean and latents_std (zeros and ones would hide a wrong normalisation)."""
    generator = torch.Generator().manual_seed(1)
    return torch.randn(LATENT_CHANNELS, generator=generator) * 0.5, torch.rand(LATENT_CHANNELS, generator=generator) + 0.5


def _vae():
    from diffusers import AutoencoderKLLTX2Video

    vae = AutoencoderKLLTX2Video(
        latent_channels=LATENT_CHANNELS, block_out_channels=(8, 16, 32, 64), decoder_block_out_channels=(8, 16, 32),
        layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
        downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"), decoder_causal=False,
        spatial_compression_ratio=32, temporal_compression_ratio=8, scaling_factor=SCALING_FACTOR)
    mean, std = _latent_statistics()
    vae.latents_mean.copy_(mean)
    vae.latents_std.copy_(std)
    return vae


def _diffusion_decoder():
    """LTX-2.5's diffusion decoder (32x spatial, 8x temporal, as the VAE), one block a stage, windows
    small enough for a 64 px clip's latent grid; the VAE's latent statistics."""
    from diffusers import LTX2VideoDiffusionDecoderModel

    decoder = LTX2VideoDiffusionDecoderModel(
        latent_channels=LATENT_CHANNELS, scaling_factor=SCALING_FACTOR, decoder_head_dim=8,
        decoder_stage_channels=(32, 16, 16, 16, 16), decoder_stage_depths=(1, 1, 1, 1, 1),
        decoder_stage_kernels=((1, 2, 2), (1, 2, 2), (3, 3, 3), (3, 3, 3)),
        decoder_upsample_channel_reductions=(2, 1, 1, 1), decoder_stage5_kernel=(3, 3, 3), decoder_t_emb_dim=16)
    mean, std = _latent_statistics()
    decoder.latents_mean.copy_(mean)
    decoder.latents_std.copy_(std)
    return decoder


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


def _transformer(audio_channels: int, ltx23: bool = False):
    """LTX-2.0's transformer, or (`ltx23`) LTX-2.3's: gated attention, the text cross-attention
    modulated by sigma, the captions projected by the connectors."""
    from diffusers import LTX2VideoTransformer3DModel

    ltx23_args = dict(gated_attn=True, cross_attn_mod=True, audio_gated_attn=True, audio_cross_attn_mod=True,
                      use_prompt_embeddings=False) if ltx23 else {}
    return LTX2VideoTransformer3DModel(
        in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=VIDEO_WIDTH, audio_in_channels=audio_channels, audio_out_channels=audio_channels,
        audio_num_attention_heads=2, audio_attention_head_dim=4, audio_cross_attention_dim=AUDIO_WIDTH, num_layers=2,
        caption_channels=TEXT_DIM, **ltx23_args)


def _components(ltx23: bool = False) -> dict:
    """Every component but the diffusion decoder, by the pipelines' names (`ltx23`: LTX-2.3's
    transformer and connectors)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    tokenizer = gemma_tokenizer()
    audio_vae = seeded(_audio_vae)
    latent_mel_bins = audio_vae.config.mel_bins // audio_vae.mel_compression_ratio
    return dict(tokenizer=tokenizer, text_encoder=seeded(_gemma3, len(tokenizer)), connectors=seeded(_connectors, ltx23),
                vae=seeded(_vae), audio_vae=audio_vae, vocoder=seeded(_vocoder, audio_vae),
                transformer=seeded(_transformer, audio_vae.config.latent_channels * latent_mel_bins, ltx23),
                scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER))


def build_tiny_ltx2(out_dir: Path, image_to_video: bool = False) -> Path:
    """Write a tiny LTX-2 into out_dir (`image_to_video`: the same components as an LTX2ImageToVideoPipeline)."""
    from diffusers import LTX2ImageToVideoPipeline, LTX2Pipeline

    pipe = (LTX2ImageToVideoPipeline if image_to_video else LTX2Pipeline)(**_components())
    pipe.save_pretrained(Path(out_dir), safe_serialization=True)
    return Path(out_dir)


def build_tiny_ltx25(out_dir: Path) -> Path:
    """Write a tiny LTX-2.5 into out_dir as diffusers ships it: an LTX25ModularPipeline saved by
    save_pretrained (modular_model_index.json, entries pointing at the folder), LTX-2.3's transformer
    and connectors, LTX-2's VAE to encode and the diffusion decoder to render; no prompt enhancer and
    no duration head (rendering gives the frame count)."""
    from diffusers.modular_pipelines import LTX25AutoBlocks

    pipe = LTX25AutoBlocks().init_pipeline()
    pipe.update_components(**_components(ltx23=True), diffusion_decoder=seeded(_diffusion_decoder))
    pipe.save_pretrained(str(Path(out_dir).absolute()), overwrite_modular_index=True)  # a str: diffusers splits it
    return Path(out_dir)
