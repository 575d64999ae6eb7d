"""Krea 2 (base and step-distilled): a single-stream flow-matching transformer on 2x2-packed
16-channel latents of Qwen-Image's video VAE (one frame), conditioned on a stack of Qwen3-VL hidden
states that its own text-fusion blocks collapse.

As Krea2Pipeline does it: Qwen-Image's system template up to the caption, tokenized padded to
max_sequence_length + 29 tokens, then the template's suffix (`<|im_end|>` + assistant turn)
appended after the padding; positions count real tokens only; the hidden states of the pipeline's
`text_encoder_select_layers` (model_index.json; a text setting) concatenated per token, the
template's first 34 tokens dropped. The transformer masks the padding out of every attention and
reads text with all-zero rotary positions, so a record keeps the real tokens only (L_i, layers x D;
at full size 12 x 2560), stored unpadded and padded per batch with its mask, which is always passed
(as the pipeline does). Latents as Qwen-Image's: per-channel latents_mean/latents_std; the
transformer reads sigma (the pipeline's t / 1000) and (0, row, col) image positions after the text.

Timesteps: the base shifts by the resolution (the scheduler config's dynamic shift, max_image_seq_len
6400); the distilled checkpoint (model_index.json's `is_distilled`, 8 steps, no guidance) by a fixed
mu = 1.15, which is the static shift e^1.15. Training on it breaks its distillation: the family names
the base instead. Guidance follows Krea's convention: cond + g (cond - uncond), on when g > 0.

Exports: diffusers format, and Krea's original names (`blocks.N.attn.wq`, `blocks.N.mlp.gate`,
`txtfusion.*`) under `diffusion_model.`, the layout Krea2LoraLoaderMixin's converter and ComfyUI read,
derived from diffusers' `convert_krea2_transformer_checkpoint_to_diffusers` (1:1, nothing fused).
Hand-written: the original module names (`ORIGINAL_*`), the converter's input.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from pydantic import Field

from lorapipe.stages.lora_formats.original_names import OriginalNames, derive_original_names, weight_keys

from .base import MODEL_INDEX, Components, Conditioning, Kohya, TextOptions, TextRecord
from .flow import FlowFamily, FlowVariant, presets_field
from .folders import model_index
from .latents import ONE_FRAME, ChannelMeanStd, VaePosterior, channel_mean_std_of
from .objectives import TimestepSampling
from .qwen_text import QwenPromptEncoder, QwenPromptSettings

if TYPE_CHECKING:
    import torch

PREFIX = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text,"
          " spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n")
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"  # Krea2Pipeline.prompt_template_encode_suffix
PREFIX_TOKENS, SUFFIX_TOKENS = 34, 5  # the pipeline's prompt_template_encode_start_idx, _num_suffix_tokens
SELECT_LAYERS = (2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35)  # the pipeline's default text_encoder_select_layers
PATCH = 2
DISTILLED_MU = 1.15  # Krea2Pipeline's fixed mu for the distilled checkpoint
TIMESTEP_SCALE = 1000  # the pipeline's scheduler timesteps are 1000 sigma; the transformer reads t / 1000
BLOCK = r"transformer_blocks\.\d+\."
ATTENTION = (BLOCK + r"attn\.(to_q|to_k|to_v|to_gate|to_out\.0)",)
FEED_FORWARD = (BLOCK + r"ff\.(gate|up|down)",)
ORIGINAL_ATTENTION = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "attn.gate", "mlp.gate", "mlp.up", "mlp.down")
ORIGINAL_TOP = ("first", "last.linear", "tmlp.0", "tmlp.2", "tproj.1", "txtmlp.1", "txtmlp.3", "txtfusion.projector")
BASE = "the Krea 2 base (midtrain) checkpoint"

VARIANTS = (
    FlowVariant("distilled", "krea2-distilled", 8, 0.0, markers=((MODEL_INDEX, "is_distilled", True),),
                distilled=True, train_instead=BASE),
    FlowVariant("base", "krea2", 28, 4.5),
)


class Krea2PromptSettings(QwenPromptSettings):
    suffix: str = Field(description="the template's end, appended after the padding")


class Krea2PromptEncoder(QwenPromptEncoder):
    """Captions -> records {"hidden_states": (L_i, layers x D)}: the real tokens after the prefix."""

    def __call__(self, captions: list[str]) -> list[TextRecord]:
        import torch

        s = self.settings
        head = self.tokenizer([self.templated(c) for c in captions], max_length=s.token_window, truncation=True,
                              padding="max_length", return_tensors="pt")
        tail = self.tokenizer([s.suffix] * len(captions), return_tensors="pt")
        ids = torch.cat([head.input_ids, tail.input_ids], dim=1).to(self.device)
        mask = torch.cat([head.attention_mask, tail.attention_mask], dim=1).bool().to(self.device)
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0).expand(3, -1, -1)  # mRoPE's t, h, w alike
        with torch.inference_mode():
            out = self.encoder(input_ids=ids, attention_mask=mask, position_ids=positions, output_hidden_states=True)
        hidden = torch.cat([out.hidden_states[i] for i in s.hidden_layers], dim=-1)
        return [{"hidden_states": hidden[i][mask[i]][s.drop_tokens:].to(self.dtype).cpu()}
                for i in range(len(captions))]


@dataclass(frozen=True)
class Krea2(FlowFamily):
    variants: tuple[FlowVariant, ...] = VARIANTS
    latent_encoder: Callable[[Path, str, str], VaePosterior] = ONE_FRAME  # Qwen-Image's video VAE
    normalisation_of: Callable[[Path, str], ChannelMeanStd] = channel_mean_std_of
    lora_presets: dict[str, tuple[str, ...]] = presets_field(ATTENTION, FEED_FORWARD, (BLOCK,))

    # ---- text
    def text_settings(self, model_path: Path, options: TextOptions) -> Krea2PromptSettings:
        length = self.text_length(options)
        layers = tuple(model_index(model_path).get("text_encoder_select_layers") or SELECT_LAYERS)
        return Krea2PromptSettings(system_template=PREFIX + "{}", suffix=SUFFIX, hidden_layers=layers,
                                   max_sequence_length=length, token_window=length + PREFIX_TOKENS - SUFFIX_TOKENS,
                                   pad_to_window=True, keep_padding=False, drop_tokens=PREFIX_TOKENS)

    # ---- latents and objective
    def model_shift(self, scheduler_config: dict) -> TimestepSampling | None:
        return TimestepSampling(shift="static", shift_value=math.exp(DISTILLED_MU)) if self.bound.distilled else None

    # ---- denoiser
    def predict(self, transformer: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                conditioning: Conditioning, dtype: torch.dtype) -> torch.Tensor:
        """As Krea2Pipeline calls its transformer: latents packed 2x2, t / 1000, the text's layers
        unstacked, (0, row, col) positions after all-zero text ones, the mask; unpacked back."""
        from diffusers import Krea2Pipeline

        b, c, h, w = noisy.shape
        text = conditioning["encoder_hidden_states"].to(device=noisy.device, dtype=dtype)
        text = text.unflatten(-1, (transformer.config.num_text_layers, -1))
        packed = noisy.view(b, c, h // PATCH, PATCH, w // PATCH, PATCH).permute(0, 2, 4, 1, 3, 5)
        positions = Krea2Pipeline.prepare_position_ids(text.shape[1], h // PATCH, w // PATCH, noisy.device)
        out = transformer(hidden_states=packed.reshape(b, -1, c * PATCH * PATCH).to(dtype),
                          encoder_hidden_states=text,
                          timestep=(timesteps * TIMESTEP_SCALE / TIMESTEP_SCALE).to(dtype), position_ids=positions,
                          encoder_attention_mask=conditioning["encoder_attention_mask"].to(noisy.device),
                          return_dict=False)[0]
        out = out.view(b, h // PATCH, w // PATCH, c, PATCH, PATCH).permute(0, 3, 1, 4, 2, 5)
        return out.reshape(b, c, h, w).float()

    # ---- LoRA
    def original_names(self, transformer: torch.nn.Module) -> OriginalNames:
        config = transformer.config
        return original_names(config.num_layers, config.num_layerwise_text_blocks, config.num_refiner_text_blocks)

    # ---- tiny model
    def build_tiny_variant(self, out_dir: Path, variant: FlowVariant) -> Path:
        from .tiny.krea2 import build_tiny_krea2

        return build_tiny_krea2(out_dir, variant.distilled)


@cache
def original_names(num_layers: int, layerwise_blocks: int, refiner_blocks: int) -> OriginalNames:
    """Krea's module names for a transformer of this shape, from diffusers' converter."""
    from diffusers.loaders.single_file_utils import convert_krea2_transformer_checkpoint_to_diffusers

    blocks = [f"blocks.{i}" for i in range(num_layers)]
    blocks += [f"txtfusion.layerwise_blocks.{i}" for i in range(layerwise_blocks)]
    blocks += [f"txtfusion.refiner_blocks.{i}" for i in range(refiner_blocks)]
    return derive_original_names(convert_krea2_transformer_checkpoint_to_diffusers,
                                 weight_keys(blocks, ORIGINAL_ATTENTION, ORIGINAL_TOP))


KREA2 = Krea2(
    name="krea2", label="Krea 2", pipeline_class="Krea2Pipeline",
    components=Components(text=("text_encoder", "tokenizer"), latent=("vae",), denoiser="transformer"),
    kohya=Kohya("krea2"), latent_patch=PATCH, text_encoder=Krea2PromptEncoder,
    single_file_markers=("blocks.0.attn.wq.weight", "model.diffusion_model.blocks.0.attn.wq.weight"),  # Krea's names
    block_lists=("transformer_blocks",),
)
