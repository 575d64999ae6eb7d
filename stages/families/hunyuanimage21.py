"""HunyuanImage 2.1: a double- and single-stream flow-matching transformer on the 64-channel latents
of a 32x VAE, conditioned on Qwen2.5-VL and, for the text a caption quotes, ByT5 (hunyuan.py).

Text, as HunyuanImagePipeline.encode_prompt does it (its own methods encode): the caption in the
pipeline's template (`TEMPLATE`, no generation prompt), tokenized padded to crop_start +
max_sequence_length (34 + 1000), Qwen2.5-VL's third hidden state from the end with the template's
first 34 tokens cut off; and the quoted text (single, double or Chinese quotes) as `Text "...". `
through ByT5 (128 tokens), one caption at a time. Records hold both at their own tokens.

Latents: the VAE's posterior (C, H/32, W/32), unscaled; normalised by the VAE config's
scaling_factor (the pipeline divides by it before decoding). The transformer reads them unpacked
(1x1 patches), 1000 sigma as its timestep, both texts with their masks.

LoRA: the diffusers file, and its blocks in ComfyUI's HunyuanImage 2.1 model's names under
`diffusion_model.` (`_comfyui`: `double_blocks.N.img_attn.qkv`, `img_mlp.0`, `img_mod.lin`,
`single_blocks.N.linear1`; hunyuan.py): that model is read by those names alone (comfy/lora.py has
no table of its own for it), and diffusers reads no such file for HunyuanImage 2.1.

The distilled checkpoint is refused: its meanflow transformer reads the sampler's next timestep as well
(`timestep_r`), which a training step, at one noise level, does not have.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field

from lorapipe.stages.lora_formats.original_names import COMFYUI, OriginalNames

from .base import Conditioning, Kohya, TextOptions, TextRecord
from .flow import FlowFamily, FlowVariant, presets_field
from .flux1 import ATTENTION, DOUBLE, FEED_FORWARD, SINGLE
from .folders import component_config
from .hunyuan import (COMPONENTS, HunyuanFamily, HunyuanTextEncoders, HunyuanTextSettings, hunyuan_video_names,
                      in_comfyui_spelling, on_device)

if TYPE_CHECKING:
    import torch

TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text,"
            " spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>")
CROP_START = 34  # HunyuanImagePipeline.prompt_template_encode_start_idx
SKIPPED_LAYERS = 2  # the pipeline reads hidden_states[-(2 + 1)]
GLYPH_LENGTH = 128  # the pipeline's tokenizer_2_max_length
TIMESTEP_SCALE = 1000  # the pipeline's timesteps are 1000 sigma, as the transformer reads them

VARIANTS = (FlowVariant("base", "hunyuanimage2.1", 50, 3.5, max_sequence_length=1000),)  # the guider's scale
BASE = "hunyuanvideo-community/HunyuanImage-2.1-Diffusers"


class HunyuanImageTextSettings(HunyuanTextSettings):
    template: str = Field(description="the pipeline's prompt_template_encode, '{}' the caption")


class HunyuanImageTextEncoder(HunyuanTextEncoders):
    """HunyuanImagePipeline.encode_prompt, batched: each caption's Qwen2.5-VL and ByT5 states at their
    own tokens. The pipeline's encoding methods read nothing of the pipeline but what they are given
    (device and dtype among it), so they run here without one."""

    def too_long(self, caption: str) -> bool:
        s = self.settings
        return len(self.tokenizer(s.template.format(caption)).input_ids) > s.crop_start + s.max_sequence_length

    def __call__(self, captions: list[str]) -> list[TextRecord]:
        import torch
        from diffusers import HunyuanImagePipeline as Pipeline

        s = self.settings
        with torch.inference_mode():
            hidden, mask = Pipeline._get_qwen_prompt_embeds(
                None, self.tokenizer, self.encoder, captions, self.device, self.encoder.dtype,
                tokenizer_max_length=s.max_sequence_length, template=s.template, drop_idx=s.crop_start,
                hidden_state_skip_layer=s.skipped_layers)
            glyphs = [self._glyph_states(caption) for caption in captions]
        return [{"hidden_states": hidden[i][mask[i].bool()].to(self.dtype).cpu(),
                 "glyph_states": glyphs[i].to(self.dtype).cpu()} for i in range(len(captions))]

    def _glyph_states(self, caption: str) -> torch.Tensor:
        """ByT5's states of the caption's quoted text at its own tokens; none without quotes."""
        from diffusers import HunyuanImagePipeline as Pipeline
        from diffusers.pipelines.hunyuan_image.pipeline_hunyuanimage import extract_glyph_text

        glyph_text = extract_glyph_text(caption)
        if glyph_text is None:
            return self.glyph_encoder.get_input_embeddings().weight[:0]
        states, mask = Pipeline._get_byt5_prompt_embeds(
            None, self.glyph_tokenizer, self.glyph_encoder, glyph_text, self.device, self.glyph_encoder.dtype,
            tokenizer_max_length=self.settings.glyph_max_length)
        return states[0][mask[0].bool()]


@dataclass(frozen=True)
class HunyuanImage21(HunyuanFamily, FlowFamily):
    variants: tuple[FlowVariant, ...] = VARIANTS
    lora_presets: dict[str, tuple[str, ...]] = presets_field(ATTENTION, FEED_FORWARD, (DOUBLE, SINGLE))

    def for_model(self, model_path: Path) -> HunyuanImage21:
        from lorapipe.cache.errors import UserError

        if component_config(model_path, self.components.denoiser).get("use_meanflow"):
            raise UserError(f"{model_path}/{self.components.denoiser}/config.json: the distilled HunyuanImage 2.1"
                            " (use_meanflow) reads the sampler's next timestep too, which training has not: train"
                            f" the base ({BASE}) instead")
        return super().for_model(model_path)

    # ---- text
    def text_settings(self, model_path: Path, options: TextOptions) -> HunyuanImageTextSettings:
        return HunyuanImageTextSettings(max_sequence_length=self.text_length(options), crop_start=CROP_START,
                                        skipped_layers=SKIPPED_LAYERS, glyph_max_length=GLYPH_LENGTH,
                                        template=TEMPLATE)

    # ---- denoiser
    def predict(self, transformer: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                conditioning: Conditioning, dtype: torch.dtype) -> torch.Tensor:
        """As HunyuanImagePipeline calls its transformer: the latents as they are, 1000 sigma, both
        texts with their masks."""
        return transformer(hidden_states=noisy.to(dtype), timestep=(timesteps * TIMESTEP_SCALE).to(noisy.device, dtype),
                           return_dict=False, **on_device(conditioning, noisy.device, dtype))[0].float()

    # ---- LoRA
    def original_names(self, transformer: torch.nn.Module) -> OriginalNames:
        config = transformer.config
        return in_comfyui_spelling(hunyuan_video_names(config.num_layers, config.num_single_layers))

    # ---- tiny model
    def build_tiny_variant(self, out_dir: Path, variant: FlowVariant) -> Path:
        from .tiny.hunyuanimage21 import build_tiny_hunyuanimage21

        return build_tiny_hunyuanimage21(out_dir)


HUNYUANIMAGE21 = HunyuanImage21(
    name="hunyuanimage2.1", label="HunyuanImage 2.1", pipeline_class="HunyuanImagePipeline",
    components=COMPONENTS,
    kohya=Kohya("hunyuan_image_2_1"), sequence_patch=1, text_encoder=HunyuanImageTextEncoder,
    original_formats=(COMFYUI,), block_lists=("transformer_blocks", "single_transformer_blocks"),
)
