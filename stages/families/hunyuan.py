"""What Tencent Hunyuan's families (HunyuanVideo 1.5, HunyuanImage 2.1) share: their text records,
Qwen2.5-VL's states and, for the text a caption quotes, ByT5's, each at its own tokens
(`hidden_states` (L, D), `glyph_states` (G, D2), G = 0 without quotes), padded per batch with masks
(the transformers gather the unmasked tokens of each first, so the padding's length changes
nothing); the guider that sets their pipelines' guidance; diffusers' LoRA loader, which their
pipelines lack in diffusers 0.42.1; and the original names of their blocks: both keep HunyuanVideo
1.0's double blocks (HunyuanImage 2.1 its single blocks too), so diffusers' HunyuanVideo converter
(convert_hunyuan_video_transformer_to_diffusers) names them, in HunyuanVideo's spelling
(`double_blocks.N.img_attn_qkv`, q|k|v fused; `img_mlp.fc1`; `img_mod.linear`; `single_blocks.N.linear1`,
q|k|v|mlp fused). ComfyUI's HunyuanVideo and HunyuanImage 2.1 models hold the same weights under
Flux's block names (`img_attn.qkv`, `img_mlp.0`, `img_mod.lin`: `COMFYUI_SPELLING`). Hand-written:
the original block module names (`ORIGINAL_DOUBLE`, `ORIGINAL_SINGLE`), the converter's input.
"""
from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from lorapipe.stages.contract import Frozen
from lorapipe.stages.lora_formats.original_names import OriginalNames, derive_original_names, weight_keys

from .base import Components, Conditioning, ImageGeometry, TextRecord, pad_sequences
from .folders import load_component
from .objectives import FlowMatchingObjective, ObjectiveParams

if TYPE_CHECKING:
    import torch


COMPONENTS = Components(text=("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"), latent=("vae",),
                        denoiser="transformer")

TEXT_INPUTS = ("encoder_hidden_states", "encoder_attention_mask", "encoder_hidden_states_2", "encoder_attention_mask_2")
ORIGINAL_DOUBLE = tuple(f"{stream}_{module}" for stream in ("img", "txt")
                        for module in ("attn_qkv", "attn_proj", "mlp.fc1", "mlp.fc2", "mod.linear"))
ORIGINAL_SINGLE = ("linear1", "linear2", "modulation.linear")
# HunyuanVideo's spelling -> ComfyUI's models' own (comfy/lora.py renames the other way for HunyuanVideo's)
COMFYUI_SPELLING = (("_attn_qkv", "_attn.qkv"), ("_attn_proj", "_attn.proj"), ("mlp.fc1", "mlp.0"),
                    ("mlp.fc2", "mlp.2"), ("_mod.linear", "_mod.lin"), ("modulation.linear", "modulation.lin"))


class HunyuanTextSettings(Frozen):
    max_sequence_length: int = Field(gt=0, description="Qwen2.5-VL tokens after the template's crop_start")
    crop_start: int = Field(ge=0, description="the template's tokens cut off the hidden states")
    skipped_layers: int = Field(ge=0, description="last hidden layers skipped: the record is hidden_states[-(n + 1)]")
    glyph_max_length: int = Field(gt=0, description="ByT5 tokens of the caption's quoted text")


class HunyuanTextEncoders:
    """A Hunyuan pipeline's two text encoders, frozen on `device`: Qwen2.5-VL (tokenizer,
    text_encoder) and ByT5 (tokenizer_2, text_encoder_2); each family's subclass encodes as its
    pipeline's encode_prompt does."""

    def __init__(self, model_path: Path, settings: HunyuanTextSettings, dtype: torch.dtype, device: str):
        self.settings, self.dtype, self.device = settings, dtype, device
        self.tokenizer = load_component(model_path, "tokenizer")
        self.encoder = load_component(model_path, "text_encoder").eval().requires_grad_(False).to(device)
        self.glyph_tokenizer = load_component(model_path, "tokenizer_2")
        self.glyph_encoder = load_component(model_path, "text_encoder_2").eval().requires_grad_(False).to(device)


class HunyuanFamily:
    """The methods the Hunyuan families share, mixed in before their FlowFamily base (a class without
    fields, so that the base's field defaults stay theirs)."""

    def conditioning(self, texts: list[TextRecord], images: list[tuple[ImageGeometry, bool]],
                     params: ObjectiveParams) -> Conditioning:
        """Both text streams padded to the batch's longest (one glyph position at least), with their masks."""
        embeds, mask = pad_sequences(texts, "hidden_states")
        glyphs, glyph_mask = pad_sequences(texts, "glyph_states", max(1, *(len(t["glyph_states"]) for t in texts)))
        return dict(zip(TEXT_INPUTS, (embeds, mask, glyphs, glyph_mask)))

    def prepare_pipeline(self, pipe: Any, sampler: str, objective: FlowMatchingObjective) -> None:
        """The pipeline with diffusers' LoRA loader for a transformer named `transformer`, which the
        Hunyuan pipelines lack in diffusers 0.42.1 (their transformers load adapters themselves)."""
        from diffusers.loaders import HunyuanVideoLoraLoaderMixin

        super().prepare_pipeline(pipe, sampler, objective)
        if not hasattr(pipe, "load_lora_weights"):
            pipe.__class__ = type(f"{type(pipe).__name__}WithLora", (type(pipe), HunyuanVideoLoraLoaderMixin), {})

    def render_kwargs(self, settings: HunyuanTextSettings, guidance_scale: float,
                      negative_prompt: str) -> dict[str, Any]:
        """The pipeline guides at its guider's scale and takes none in the call: another is refused, not ignored."""
        if guidance_scale != self.bound.render_guidance:
            raise ValueError(f"evaluate.guidance_scale: {self.pipeline_class} guides at its guider's scale"
                             f" (guider/guider_config.json), not {guidance_scale:g}; remove it")
        return {"negative_prompt": negative_prompt}


def on_device(conditioning: Conditioning, device: torch.device, dtype: torch.dtype) -> Conditioning:
    """The conditioning on the denoiser's device, its states in the denoiser's dtype, its masks as they are."""
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in conditioning.items()}


@cache
def hunyuan_video_names(num_layers: int, num_single_layers: int) -> OriginalNames:
    """HunyuanVideo's original names of the blocks of a transformer of this shape, from diffusers' converter
    (its single blocks' q|k|v|mlp split is 1:1:1:4, any width, at the mlp_ratio 4 both families have)."""
    from diffusers.loaders.single_file_utils import convert_hunyuan_video_transformer_to_diffusers

    seeds = weight_keys((f"double_blocks.{i}" for i in range(num_layers)), ORIGINAL_DOUBLE) + \
        weight_keys((f"single_blocks.{i}" for i in range(num_single_layers)), ORIGINAL_SINGLE)
    return derive_original_names(convert_hunyuan_video_transformer_to_diffusers, seeds)


def in_comfyui_spelling(names: OriginalNames) -> OriginalNames:
    """The same weights under ComfyUI's models' names."""
    def spelt(name: str) -> str:
        for original, comfyui in COMFYUI_SPELLING:
            name = name.replace(original, comfyui)
        return name

    return {spelt(name): rows for name, rows in names.items()}
