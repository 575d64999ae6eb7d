"""Ideogram 4: a single-stream flow-matching transformer over one packed sequence of text tokens and
2x2-patchified, batch-normalised 32-channel latents of Flux.2's VAE, conditioned on a stack of
Qwen3-VL hidden states; guided asymmetrically by a second, unconditional transformer.

As Ideogram4Pipeline does it: the caption as one user message in the tokenizer's chat template,
left-padded, positions counting real tokens only; the hidden states of the 13 decoder layers the
pipeline taps (its fixed QWEN3_VL_ACTIVATION_LAYERS, computed by the pipeline's own helper)
interleaved per token (D x 13 values, layer fastest). The transformer's segment ids keep the padding
out of every attention and the text's positions start at 0 whatever the padding, so a record keeps
the real tokens only, stored unpadded and left-padded per batch. Latents: the VAE's mean patchified
2x2 with (row, column, channel) patched channels and normalised by its batch-norm statistics
(latents.PatchMajorBatchNorm), read as row-major tokens after the text.

Time and sign: the transformer reads model time 1 - sigma (0 noise, 1 data) and predicts data minus
noise, the negative of the objective's velocity. Only `transformer` (the conditional one) is
trained and exported, as Ideogram4LoraLoaderMixin loads it; the unconditional transformer renders
untouched. Training draws its noise levels as the pipeline samples them (`shift: model`): sigma
logit-normal, its mean shifted by half the log of the image's pixels over 512x512
(objectives.logit_normal_schedule). Rendering uses one constant guidance scale (the pipeline's
default is a per-step schedule) and the pipeline's own logit-normal sigma schedule. Exports: diffusers format, and
Ideogram's names (`layers.N.attention.qkv` q|k|v fused, `attention.o`) under `diffusion_model.`,
which the mixin's non-diffusers converter reads. Hand-written: those names (diffusers keeps no
single-file converter for Ideogram 4 to derive them from).
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from functools import cache, partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from lorapipe.stages.lora_formats.original_names import OriginalNames, Segment

from .base import Components, Conditioning, Kohya, TextOptions, TextRecord
from .flow import FlowFamily, FlowVariant, presets_field, refuse_negative_prompt
from .latents import PatchedBatchNorm, PatchMajorBatchNorm, patched_batch_norm_of
from .objectives import TimestepSampling
from .qwen_text import QwenPromptEncoder, QwenPromptSettings

if TYPE_CHECKING:
    import torch

PATCH = 2
BLOCK = r"layers\.\d+\."
ATTENTION = (BLOCK + r"attention\.(to_q|to_k|to_v|to_out\.0)",)
FEED_FORWARD = (BLOCK + r"feed_forward\.(w1|w2|w3)",)
ONE_TO_ONE = ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3", "adaln_modulation")

VARIANTS = (FlowVariant("ideogram4", "ideogram4", 48, 7.0, max_sequence_length=2048),)
# the Qwen3-VL layers Ideogram4Pipeline taps, as its module's QWEN3_VL_ACTIVATION_LAYERS: written out, as
# encode's key reads them and a run served wholly from the cache imports no diffusers (tests check they agree)
TAPPED_LAYERS = (0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 33, 35)


class Ideogram4PromptEncoder(QwenPromptEncoder):
    """Captions -> records {"hidden_states": (L_i, D x 13)}: the templated caption's own tokens."""

    def templated(self, caption: str) -> str:
        message = {"role": "user", "content": [{"type": "text", "text": caption}]}
        return self.tokenizer.apply_chat_template([message], add_generation_prompt=True, tokenize=False)

    def too_long(self, caption: str) -> bool:
        return len(self._tokens(caption)) > self.settings.max_sequence_length

    def _tokens(self, caption: str) -> torch.Tensor:
        return self.tokenizer(self.templated(caption), add_special_tokens=False, return_tensors="pt").input_ids[0]

    def __call__(self, captions: list[str]) -> list[TextRecord]:
        import torch
        from diffusers import Ideogram4Pipeline

        rows = [self._tokens(c)[: self.settings.max_sequence_length] for c in captions]
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask, positions = torch.zeros_like(ids), torch.zeros_like(ids)
        for i, row in enumerate(rows):  # left-padded, as the pipeline's encode_prompt
            ids[i, width - len(row):], mask[i, width - len(row):] = row, 1
            positions[i, width - len(row):] = torch.arange(len(row))
        with torch.inference_mode():
            tapped = Ideogram4Pipeline._get_text_encoder_hidden_states(
                self.encoder, ids.to(self.device), mask.to(self.device), positions.to(self.device))
        features = torch.stack(tapped, dim=0).permute(1, 2, 3, 0).flatten(2)
        return [{"hidden_states": features[i, width - len(row):].to(self.dtype).cpu()} for i, row in enumerate(rows)]


def left_padded(embeds: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Right-padded rows (pad_sequences) moved to the row's end, the padding first."""
    import torch

    return torch.stack([row.roll(embeds.shape[1] - n, dims=0) for row, n in zip(embeds, lengths)])


@dataclass(frozen=True)
class Ideogram4(FlowFamily):
    variants: tuple[FlowVariant, ...] = VARIANTS
    normalisation_of: Callable[[Path, str], PatchedBatchNorm] = partial(patched_batch_norm_of, kind=PatchMajorBatchNorm)
    lora_presets: dict[str, tuple[str, ...]] = presets_field(ATTENTION, FEED_FORWARD, (BLOCK,))

    # ---- text
    def text_settings(self, model_path: Path, options: TextOptions) -> QwenPromptSettings:
        length = self.text_length(options)
        return QwenPromptSettings(hidden_layers=TAPPED_LAYERS, max_sequence_length=length,
                                  token_window=length, pad_to_window=False, keep_padding=False)

    # ---- latents and objective
    def model_shift(self, scheduler_config: dict) -> TimestepSampling:
        """The pipeline's logit-normal schedule at its call's default mean and deviation."""
        import inspect

        from diffusers import Ideogram4Pipeline

        defaults = inspect.signature(Ideogram4Pipeline.__call__).parameters
        return TimestepSampling(shift="logit_normal", shift_mean=defaults["mu"].default,
                                shift_std=defaults["std"].default)

    # ---- denoiser
    def predict(self, transformer: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                conditioning: Conditioning, dtype: torch.dtype) -> torch.Tensor:
        """As Ideogram4Pipeline calls its conditional transformer: [padding][text][image tokens],
        model time 1 - sigma; the image tokens' output, negated, unpacked back."""
        import torch
        from diffusers import Ideogram4Pipeline

        b, c, h, w = noisy.shape
        lengths = conditioning["encoder_attention_mask"].sum(1).tolist()
        text = left_padded(conditioning["encoder_hidden_states"], lengths).to(device=noisy.device, dtype=dtype)
        width = text.shape[1]
        positions, segments, indicator = Ideogram4Pipeline._prepare_ids(lengths, h, w, width, noisy.device)
        tokens = noisy.permute(0, 2, 3, 1).reshape(b, h * w, c)
        out = transformer(hidden_states=torch.cat([tokens.new_zeros(b, width, c), tokens], dim=1).to(dtype),
                          timestep=(1 - timesteps).to(dtype),
                          encoder_hidden_states=torch.cat([text, text.new_zeros(b, h * w, text.shape[2])], dim=1),
                          position_ids=positions, segment_ids=segments, indicator=indicator, return_dict=False)[0]
        return -out[:, width:].reshape(b, h, w, c).permute(0, 3, 1, 2).float()

    # ---- LoRA
    def original_names(self, transformer: torch.nn.Module) -> OriginalNames:
        return original_names(transformer.config.num_layers)

    # ---- rendering
    def render_kwargs(self, settings: QwenPromptSettings, guidance_scale: float,
                      negative_prompt: str) -> dict[str, Any]:
        refuse_negative_prompt(negative_prompt, "Ideogram4Pipeline guides with its unconditional transformer and"
                                                " takes no negative prompt")
        return {"guidance_scale": guidance_scale, "guidance_schedule": None,
                "max_sequence_length": settings.max_sequence_length}

    # ---- tiny model
    def build_tiny_variant(self, out_dir: Path, variant: FlowVariant) -> Path:
        from .tiny.ideogram4 import build_tiny_ideogram4

        return build_tiny_ideogram4(out_dir)


@cache
def original_names(num_layers: int) -> OriginalNames:
    """Ideogram's module names, as the mixin's converter reads them: q|k|v thirds of
    `attention.qkv`, `attention.o` for `to_out.0`, the rest one to one."""
    whole, third = (Fraction(0), Fraction(1)), Fraction(1, 3)
    names: OriginalNames = {}
    for i in range(num_layers):
        block = f"layers.{i}."
        names[block + "attention.qkv"] = tuple(Segment(block + f"attention.{m}", k * third, (k + 1) * third, *whole)
                                               for k, m in enumerate(("to_q", "to_k", "to_v")))
        names[block + "attention.o"] = (Segment(block + "attention.to_out.0", *whole, *whole),)
        names.update({block + m: (Segment(block + m, *whole, *whole),) for m in ONE_TO_ONE})
    return names


IDEOGRAM4 = Ideogram4(
    name="ideogram4", label="Ideogram 4", pipeline_class="Ideogram4Pipeline",
    components=Components(text=("text_encoder", "tokenizer"), latent=("vae",), denoiser="transformer"),
    kohya=Kohya("ideogram4"), latent_patch=PATCH, text_encoder=Ideogram4PromptEncoder,
    sequence_patch=1, block_lists=("layers",),
)
