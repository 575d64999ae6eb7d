"""HunyuanVideo 1.5 (text-to-video): a flow-matching video transformer on the latents of its causal
3-D VAE, conditioned on Qwen2.5-VL and, for the text a caption quotes, ByT5.

Text, as HunyuanVideo15Pipeline.encode_prompt does it (its own static methods encode): the caption in
the pipeline's chat template (its system message), tokenized padded to crop_start + max_sequence_length
(108 + 1000) with a mask, Qwen2.5-VL's third hidden state from the end with the template's first
crop_start tokens cut off; and the quoted text (`"..."`), if any, as `Text "...". ` through ByT5 (256
tokens). A record holds both at their own tokens (`hidden_states` (L, 3584), `glyph_states` (G, 1472),
G = 0 without quotes), padded per batch with masks as the Hunyuan families do (hunyuan.py).

Latents: records (C, F', H', W') of the VAE's posterior, unscaled, encoded one clip at a time
(diffusers' VAE fails on a batch of several); 4k + 1 frames become k + 1 latent
frames, 16x spatial; normalised by the VAE config's scaling_factor (the pipeline divides by it
before decoding). The transformer reads the latents with the text-to-video condition channels (zero
latents and a zero mask) after them, 1000 sigma as the timestep, and zero image embeddings, as the
pipeline calls it.

LoRA: the diffusers file, and its double blocks in HunyuanVideo's original names under
`diffusion_model.` (`_comfyui`; hunyuan.py): ComfyUI's HunyuanVideo model (its HunyuanVideo 1.5 one
a subclass) reads that spelling (comfy/lora.py renames it onto its own), and diffusers' HunyuanVideo
LoRA loader converts it back. Modules outside the blocks have no original name here.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lorapipe.stages.lora_formats.original_names import COMFYUI, OriginalNames

from .base import Conditioning, Kohya, TextOptions, TextRecord
from .flow import presets_field
from .folders import component_config
from .hunyuan import (COMPONENTS, TEXT_INPUTS, HunyuanFamily, HunyuanTextEncoders, HunyuanTextSettings,
                      hunyuan_video_names, on_device)
from .video import ClipPosterior, VideoFamily, VideoVariant

if TYPE_CHECKING:
    import torch

BLOCK = r"transformer_blocks\.\d+\."
ATTENTION = (BLOCK + r"attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)",)
FEED_FORWARD = (BLOCK + r"(ff|ff_context)\.net\.(0\.proj|2)",)
TIMESTEP_SCALE = 1000  # the pipeline's timesteps are 1000 sigma, as the transformer reads them
CROP_START = 108  # the pipeline's prompt_template_encode_start_idx: the template's tokens cut off
SKIPPED_LAYERS = 2  # the pipeline reads hidden_states[-(2 + 1)]
GLYPH_LENGTH = 256  # the pipeline's tokenizer_2_max_length: ByT5 tokens of the quoted text
IMAGE_TOKENS = 729  # the pipeline's vision_num_semantic_tokens: zero image embeddings in text-to-video

VARIANTS = (VideoVariant("1.5-t2v", "hunyuanvideo1.5", 50, 6.0, max_sequence_length=1000, render_frames=121),)


class HunyuanVideo15TextEncoder(HunyuanTextEncoders):
    """HunyuanVideo15Pipeline.encode_prompt, batched: each caption's Qwen2.5-VL and ByT5 states at
    their own tokens."""

    def too_long(self, caption: str) -> bool:
        from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import format_text_input

        tokens = self.tokenizer.apply_chat_template(format_text_input([caption], self._system_message())[0],
                                                    add_generation_prompt=True, tokenize=True)
        return len(tokens) > self.settings.crop_start + self.settings.max_sequence_length

    @staticmethod
    def _system_message() -> str:
        import inspect

        from diffusers import HunyuanVideo15Pipeline

        return inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters["system_message"].default

    def __call__(self, captions: list[str]) -> list[TextRecord]:
        import torch
        from diffusers import HunyuanVideo15Pipeline as Pipeline

        s = self.settings
        with torch.inference_mode():
            hidden, mask = Pipeline._get_mllm_prompt_embeds(
                self.encoder, self.tokenizer, captions, self.device, tokenizer_max_length=s.max_sequence_length,
                num_hidden_layers_to_skip=s.skipped_layers, crop_start=s.crop_start)
            glyphs, glyph_mask = Pipeline._get_byt5_prompt_embeds(self.glyph_tokenizer, self.glyph_encoder, captions,
                                                                  self.device, tokenizer_max_length=s.glyph_max_length)
        return [{"hidden_states": hidden[i][mask[i].bool()].to(self.dtype).cpu(),
                 "glyph_states": glyphs[i][glyph_mask[i].bool()].to(self.dtype).cpu()} for i in range(len(captions))]


class ClipByClip(ClipPosterior):
    """ClipPosterior one clip at a time: the VAE's mid-block attention fails on a batch of several
    (its causal mask, (B, L, L), does not broadcast against the (B, 1, L, C) queries)."""

    def __call__(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        encode = super().__call__
        means, stds = zip(*(encode(clip[None]) for clip in pixels))
        return torch.cat(means), torch.cat(stds)


@dataclass(frozen=True)
class HunyuanVideo15(HunyuanFamily, VideoFamily):
    variants: tuple[VideoVariant, ...] = VARIANTS
    lora_presets: dict[str, tuple[str, ...]] = presets_field(ATTENTION, FEED_FORWARD, (BLOCK,))

    def temporal_compression(self, model_path: Path) -> int:
        return component_config(model_path, self.components.latent[0]).get("temporal_compression_ratio", 4)

    # ---- text
    def text_settings(self, model_path: Path, options: TextOptions) -> HunyuanTextSettings:
        return HunyuanTextSettings(max_sequence_length=self.text_length(options), crop_start=CROP_START,
                                   skipped_layers=SKIPPED_LAYERS, glyph_max_length=GLYPH_LENGTH)

    # ---- denoiser
    def predict(self, transformer: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                conditioning: Conditioning, dtype: torch.dtype) -> torch.Tensor:
        """As HunyuanVideo15Pipeline calls its transformer: the latents (B, C, F, H, W) followed by
        the zero condition latents and mask, 1000 sigma, both texts with their masks, zero image
        embeddings (which the transformer then masks out)."""
        import torch

        condition, image = self.image_inputs(transformer, noisy, conditioning, dtype)
        text = on_device({k: conditioning[k] for k in TEXT_INPUTS}, noisy.device, dtype)
        return transformer(hidden_states=torch.cat([noisy.to(dtype), condition], dim=1), image_embeds=image,
                           timestep=(timesteps * TIMESTEP_SCALE).to(noisy.device, dtype), return_dict=False,
                           **text)[0].float()

    def image_inputs(self, transformer: torch.nn.Module, noisy: torch.Tensor, conditioning: Conditioning,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Text-to-video's: zero condition latents and mask after the latents, zero image embeddings."""
        import torch

        batch, channels, frames, height, width = noisy.shape
        condition = torch.zeros(batch, channels + 1, frames, height, width, device=noisy.device, dtype=dtype)
        image = torch.zeros(batch, IMAGE_TOKENS, transformer.config.image_embed_dim, device=noisy.device, dtype=dtype)
        return condition, image

    # ---- LoRA
    def original_names(self, transformer: torch.nn.Module) -> OriginalNames:
        return hunyuan_video_names(transformer.config.num_layers, 0)

    # ---- tiny model
    def build_tiny_variant(self, out_dir: Path, variant: VideoVariant) -> Path:
        from .tiny.hunyuanvideo15 import build_tiny_hunyuanvideo15

        return build_tiny_hunyuanvideo15(out_dir)


HUNYUANVIDEO15 = HunyuanVideo15(
    name="hunyuanvideo1.5", label="HunyuanVideo 1.5", pipeline_class="HunyuanVideo15Pipeline",
    components=COMPONENTS,
    kohya=Kohya("hunyuan_video_1_5"), sequence_patch=1, text_encoder=HunyuanVideo15TextEncoder,
    latent_encoder=ClipByClip,
    original_formats=(COMFYUI,), clip_fps=24, block_lists=("transformer_blocks",),
)
