"""LTX-2: Lightricks' audio-video flow-matching transformer, trained here on video alone, on the
latents of its causal 3-D VAE, conditioned on Gemma 3 through the pipeline's text connectors.

Text, as LTX2Pipeline encodes a prompt: the caption stripped, tokenized left-padded to
max_sequence_length (1024, the pipeline's default) with a mask, every hidden state of Gemma (its
embeddings and each layer's) stacked per token, then the text connectors (`connectors`: each layer
normalised over the caption's tokens, projected, then a small transformer whose learnable
registers take the padding's place). A record is the video connector's output and its mask,
(max_sequence_length, D) at full length: the registers make every row depend on the caption, so no
row can be left out. The connectors belong to the text side: the pipeline runs them once per prompt,
not per step, and a LoRA does not train them (diffusers' LTX-2 loader saves transformer LoRAs only),
so caching their output spares every training step their two transformer layers and stores D
numbers per token where the stacked hidden states are D x (layers + 1) (49 x 3840 for Gemma 3 12B).
A record depends on the connectors' weights: they are a text component, in every record's key.

Latents: records (C, F', H', W') of the VAE's posterior, unscaled; it keeps the first frame and packs
every `temporal_compression_ratio` (8) after it, so clips are 8k + 1 frames; an image is a one-frame
clip. Normalised per channel with the VAE's latents_mean/latents_std buffers (weights, not config)
and its config's scaling_factor, as the pipeline's _normalize_latents does.

Audio is left out. The transformer denoises video and audio together and its video attends to the
audio (audio-to-video cross-attention); `predict` calls it as the pipeline's modality-isolation pass
does (isolate_modalities: no cross-attention between the streams), where the video prediction does
not depend on the audio stream, which gets one placeholder token. The LoRA presets adapt the video
stream only (attn1, attn2, ff): the audio modules get no gradient from a video loss. Rendering uses
the pipeline as it is, with audio; the audio is not kept.

The objective: flow matching with the scheduler's resolution-dependent shift, mu linear in the
clip's token count (frames x height x width latent pixels, 1x1x1 patches) from base_shift at
base_image_seq_len to max_shift at max_image_seq_len, as the pipeline shifts its sigmas;
timestep_sampling.distribution logit_normal gives LTX-2's own trainer's shifted logit-normal.
The transformer reads 1000 sigma and the clip's frame rate (its positions are in seconds).

Exports: diffusers format, and LTX-2's original names under `diffusion_model.` (ComfyUI's, which
diffusers' LTX-2 loader converts): within the blocks the same as diffusers' (`transformer_blocks.N.
attn1.to_q`), renamed at the top (`patchify_proj`, `adaln_single`, ...), as diffusers'
convert_ltx2_transformer_to_diffusers maps them. Hand-written: the original module names
(`ORIGINAL_*`), the converter's input.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from lorapipe.stages.contract import Frozen

from .base import Components, Conditioning, ImageGeometry, Kohya, LatentGeometry, TextOptions, TextRecord, stack
from .flow import presets_field
from .folders import component_config, component_tensors, load_component
from .latents import ChannelMeanStd
from .objectives import ObjectiveParams
from lorapipe.stages.lora_formats.original_names import OriginalNames, derive_original_names, weight_keys
from .video import VideoFamily, VideoVariant

if TYPE_CHECKING:
    import torch

BLOCK = r"transformer_blocks\.\d+\."
ATTENTION = (BLOCK + r"(attn1|attn2)\.(to_q|to_k|to_v|to_out\.0)",)
FEED_FORWARD = (BLOCK + r"ff\.net\.(0\.proj|2)",)
VIDEO_STREAM = (BLOCK + r"(attn1|attn2|ff)\.",)  # all_linear: every Linear of the blocks' video stream
ORIGINAL_ATTENTION = ("attn1", "attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")
ORIGINAL_BLOCK_MODULES = (*(f"{a}.{p}" for a in ORIGINAL_ATTENTION  # to_gate_logits: LTX-2.3's gated attention
                            for p in ("to_q", "to_k", "to_v", "to_out.0", "to_gate_logits")),
                          "ff.net.0.proj", "ff.net.2", "audio_ff.net.0.proj", "audio_ff.net.2")
ORIGINAL_MODULATIONS = ("adaln_single", "audio_adaln_single", "av_ca_video_scale_shift_adaln_single",
                        "av_ca_audio_scale_shift_adaln_single", "av_ca_a2v_gate_adaln_single",
                        "av_ca_v2a_gate_adaln_single")
ORIGINAL_CAPTION_PROJECTIONS = ("caption_projection", "audio_caption_projection")
ORIGINAL_TOP_MODULES = ("patchify_proj", "audio_patchify_proj", "proj_out", "audio_proj_out",
                        *(f"{c}.linear_{i}" for c in ORIGINAL_CAPTION_PROJECTIONS for i in (1, 2)),
                        *(f"{m}.{p}" for m in ORIGINAL_MODULATIONS
                          for p in ("linear", "emb.timestep_embedder.linear_1", "emb.timestep_embedder.linear_2")))
TIMESTEP_SCALE = 1000  # the pipeline's timesteps are 1000 sigma, as the transformer reads them
FRAME_RATE = 24  # the pipeline's default frame_rate: rendered clips, and an image's positions in time
PADDING_SIDE = "left"  # the pipeline pads Gemma's prompts on the left, and tells the connectors so

VARIANTS = (VideoVariant("2", "ltx2", 30, 3.0, max_sequence_length=1024, render_frames=121),)


class LTX2TextSettings(Frozen):
    max_sequence_length: int = Field(gt=0, description="Gemma tokens, left-padded; a record holds the connectors'"
                                     " output at every one of them (the caption's, and registers in the padding's"
                                     " place)")


class LTX2TextEncoder:
    """LTX2Pipeline's encode_prompt and its connectors, batched: each caption's video text embedding
    and attention mask, as the transformer receives them."""

    def __init__(self, model_path: Path, settings: LTX2TextSettings, dtype: torch.dtype, device: str):
        self.settings, self.dtype, self.device = settings, dtype, device
        self.tokenizer = load_component(model_path, "tokenizer")
        self.tokenizer.padding_side = PADDING_SIDE
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.encoder = load_component(model_path, "text_encoder").eval().requires_grad_(False).to(device)
        # Gemma loads as stored (bf16 when published), diffusers' connectors in float32 unless told
        self.connectors = load_component(model_path, "connectors", torch_dtype=self.encoder.dtype)
        self.connectors.eval().requires_grad_(False).to(device)

    def too_long(self, caption: str) -> bool:
        return len(self.tokenizer(caption.strip()).input_ids) > self.settings.max_sequence_length

    def __call__(self, captions: list[str]) -> list[TextRecord]:
        import torch

        tokens = self.tokenizer([c.strip() for c in captions], padding="max_length",
                                max_length=self.settings.max_sequence_length, truncation=True,
                                add_special_tokens=True, return_tensors="pt")
        ids, mask = tokens.input_ids.to(self.device), tokens.attention_mask.to(self.device)
        with torch.inference_mode():
            layers = self.encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
            video, _, video_mask = self.connectors(torch.stack(layers, dim=-1).flatten(2, 3), mask,
                                                   padding_side=PADDING_SIDE)
        return [{"hidden_states": video[i].to(self.dtype).cpu(), "attention_mask": video_mask[i].bool().cpu()}
                for i in range(len(captions))]


@dataclass(frozen=True)
class LTX2Family(VideoFamily):
    variants: tuple[VideoVariant, ...] = VARIANTS
    lora_presets: dict[str, tuple[str, ...]] = presets_field(ATTENTION, FEED_FORWARD, VIDEO_STREAM)
    audio_widths: tuple[int, int] = (0, 0)  # (latent, text) features of the transformer's audio stream; for_model

    def for_model(self, model_path: Path) -> LTX2Family:
        config = component_config(model_path, self.components.denoiser)
        text = config["caption_channels"] if config.get("use_prompt_embeddings", True) \
            else config["audio_cross_attention_dim"]
        return replace(super().for_model(model_path), audio_widths=(config["audio_in_channels"], text))

    def temporal_compression(self, model_path: Path) -> int:
        return _compression(component_config(model_path, self.components.latent[0]), "temporal")

    def geometry(self, model_path: Path) -> LatentGeometry:
        return LatentGeometry(_compression(component_config(model_path, self.components.latent[0]), "spatial"),
                              self.latent_patch)

    # ---- text
    def text_settings(self, model_path: Path, options: TextOptions) -> LTX2TextSettings:
        length = self.text_length(options)
        config = component_config(model_path, "connectors")
        registers = {config.get(f"{s}_connector_num_learnable_registers") for s in ("video", "audio")} - {None}
        if any(length % r for r in registers):
            raise ValueError(f"encode.max_sequence_length: LTX-2's text connectors fill the padding with"
                             f" {max(registers)} learnable registers at a time: give a multiple of it, not {length}")
        return LTX2TextSettings(max_sequence_length=length)

    # ---- denoiser
    def conditioning(self, texts: list[TextRecord], images: list[tuple[ImageGeometry, bool]],
                     params: ObjectiveParams) -> Conditioning:
        import torch

        return {"encoder_hidden_states": stack(texts, "hidden_states"),
                "encoder_attention_mask": stack(texts, "attention_mask"),
                "frame_rate": torch.tensor([float(image.fps or FRAME_RATE) for image, _ in images])}

    def predict(self, transformer: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                conditioning: Conditioning, dtype: torch.dtype) -> torch.Tensor:
        """As LTX2Pipeline's modality-isolation pass calls its transformer: the latents packed into
        (B, F x H x W, C) tokens, 1000 sigma as timestep and sigma, the cached text, the clip's frame
        rate; the audio stream one placeholder token (without cross-attention the video does not read it)."""
        t = (timesteps.float() * TIMESTEP_SCALE).to(noisy.device)
        return self.transformer_call(transformer, noisy, t, t, conditioning, dtype)

    def transformer_call(self, transformer: torch.nn.Module, noisy: torch.Tensor, t: torch.Tensor,
                         video_t: torch.Tensor, conditioning: Conditioning, dtype: torch.dtype) -> torch.Tensor:
        """predict's transformer call at timestep `t` (B,), the video's tokens at `video_t` ((B,) or
        per token)."""
        import torch
        from diffusers import LTX2Pipeline

        rates = conditioning["frame_rate"].unique()
        if len(rates) > 1:
            raise ValueError(f"LTX-2 takes one frame rate per batch, not {rates.tolist()}")
        batch, _, frames, height, width = noisy.shape
        audio = torch.zeros(batch, 1, self.audio_widths[0], device=noisy.device, dtype=dtype)
        audio_text = torch.zeros(batch, 1, self.audio_widths[1], device=noisy.device, dtype=dtype)
        video = transformer(
            hidden_states=LTX2Pipeline._pack_latents(noisy.to(dtype)), audio_hidden_states=audio,
            encoder_hidden_states=conditioning["encoder_hidden_states"].to(device=noisy.device, dtype=dtype),
            audio_encoder_hidden_states=audio_text, timestep=video_t, audio_timestep=t, sigma=t,
            encoder_attention_mask=conditioning["encoder_attention_mask"].to(noisy.device),
            num_frames=frames, height=height, width=width, fps=float(rates[0]), audio_num_frames=1,
            isolate_modalities=True, return_dict=False)[0]
        return LTX2Pipeline._unpack_latents(video, frames, height, width).float()

    # ---- LoRA
    def original_names(self, transformer: torch.nn.Module) -> OriginalNames:
        return original_names(transformer.config.num_layers)

    # ---- rendering
    def clip_kwargs(self, model_path: Path, num_frames: int | None, fps: float) -> dict[str, Any]:
        return {**super().clip_kwargs(model_path, num_frames, fps), "frame_rate": float(fps)}

    # ---- tiny model
    def build_tiny_variant(self, out_dir: Path, variant: VideoVariant) -> Path:
        from .tiny.ltx2 import build_tiny_ltx2

        return build_tiny_ltx2(out_dir)


def normalisation_of(model_path: Path, vae: str) -> ChannelMeanStd:
    """(z - mean) * scaling_factor / std, the buffers read from the VAE's weights."""
    scale = component_config(model_path, vae).get("scaling_factor", 1.0)
    stats = component_tensors(model_path, vae, ("latents_mean", "latents_std"))
    return ChannelMeanStd(mean=tuple(stats["latents_mean"].tolist()),
                          std=tuple((stats["latents_std"] / scale).tolist()))


def _compression(vae_config: dict, axis: str) -> int:
    """The VAE's spatial or temporal compression as AutoencoderKLLTX2Video sets it: its config's
    ratio, else its patch size times 2 to the number of downsampling blocks."""
    patch = vae_config["patch_size"] if axis == "spatial" else vae_config["patch_size_t"]
    return vae_config.get(f"{axis}_compression_ratio") or patch * 2 ** sum(vae_config["spatio_temporal_scaling"])


@cache
def original_names(num_layers: int) -> OriginalNames:
    """LTX-2's original module names for a transformer of this depth, from diffusers' converter."""
    from diffusers.loaders.single_file_utils import convert_ltx2_transformer_to_diffusers

    blocks = (f"transformer_blocks.{i}" for i in range(num_layers))
    seeds = weight_keys(blocks, ORIGINAL_BLOCK_MODULES, ORIGINAL_TOP_MODULES)
    return derive_original_names(convert_ltx2_transformer_to_diffusers, seeds)


LTX2 = LTX2Family(
    name="ltx2", label="LTX-2", pipeline_class="LTX2Pipeline",
    components=Components(text=("text_encoder", "tokenizer", "connectors"), latent=("vae",), denoiser="transformer"),
    kohya=Kohya("ltx2"), sequence_patch=1, text_encoder=LTX2TextEncoder, normalisation_of=normalisation_of,
    clip_fps=FRAME_RATE, block_lists=("transformer_blocks",),
    single_file_markers=("adaln_single.emb.timestep_embedder.linear_1.weight",  # Lightricks' names
                         "model.diffusion_model.adaln_single.emb.timestep_embedder.linear_1.weight"),
    checkpoint_prefixes={"vae": "vae."},  # in Lightricks' whole checkpoint (the transformer under ComfyUI's prefix)
)
