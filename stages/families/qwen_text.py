"""Prompt encoding with a Qwen language model (Qwen3 for Z-Image and Flux.2-klein, Qwen2.5-VL for
Qwen-Image): template, tokenize, run the decoder, take hidden states. One encoder, driven by the
settings each family fills in from its pipeline's `encode_prompt`:

- Z-Image: the tokenizer's chat template (thinking on), padded to max_sequence_length, the
  penultimate hidden layer, the caption's own tokens kept (variable length);
- Flux.2-klein: the chat template with thinking off, padded to max_sequence_length, three hidden
  layers concatenated per token, every position kept (its transformer reads the padding's states);
- Qwen-Image: the pipeline's own system template, padded to the batch's longest, the last hidden
  layer, the caption's tokens kept after the template's first 34 (its system prefix).

Every field is in the text record's key; the chat template itself is part of the tokenizer's files.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field

from lorapipe.stages.contract import Frozen

from .base import TextRecord
from .folders import load_component

if TYPE_CHECKING:
    import torch


class QwenPromptSettings(Frozen):
    system_template: str | None = Field(None, description="the pipeline's own template, '{}' the caption;"
                                        " None: the tokenizer's chat template for one user message")
    enable_thinking: bool | None = Field(None, description="the chat template's switch")
    hidden_layers: tuple[int, ...] = Field(description="hidden_states indices, concatenated per token")
    max_sequence_length: int = Field(gt=0, description="tokens a record holds at most")
    token_window: int = Field(gt=0, description="tokens the templated caption is truncated to")
    pad_to_window: bool = Field(description="tokenize padded to token_window (else to the batch's longest)")
    keep_padding: bool = Field(description="the record keeps the padding's positions (else only the caption's)")
    drop_tokens: int = Field(0, ge=0, description="template tokens dropped from the record's start")


class QwenPromptEncoder:
    """Captions -> records {"hidden_states": (L, D)}: L = max_sequence_length when the padding is
    kept, else the caption's own token count (stored unpadded; families pad per batch)."""

    add_special_tokens = True  # False where the chat template writes the bos itself, as processors then tokenize

    def __init__(self, model_path: Path, settings: QwenPromptSettings, dtype: torch.dtype, device: str,
                 tokenizer: str = "tokenizer", encoder: str = "text_encoder"):
        self.settings, self.dtype, self.device = settings, dtype, device
        self.tokenizer = load_component(model_path, tokenizer)
        self.encoder = load_component(model_path, encoder).eval().requires_grad_(False).to(device)

    def templated(self, caption: str) -> str:
        s = self.settings
        if s.system_template is not None:
            return s.system_template.format(caption)
        return self.tokenizer.apply_chat_template([{"role": "user", "content": caption}], tokenize=False,
                                                  add_generation_prompt=True, enable_thinking=s.enable_thinking)

    def too_long(self, caption: str) -> bool:
        tokens = len(self.tokenizer(self.templated(caption), add_special_tokens=self.add_special_tokens).input_ids)
        s = self.settings
        return tokens > s.token_window or tokens - s.drop_tokens > s.max_sequence_length

    def __call__(self, captions: list[str]) -> list[TextRecord]:
        s = self.settings
        tokens = self.tokenizer([self.templated(c) for c in captions], max_length=s.token_window, truncation=True,
                                padding="max_length" if s.pad_to_window else True, return_tensors="pt",
                                add_special_tokens=self.add_special_tokens)
        mask = tokens.attention_mask.to(self.device)
        hidden = hidden_states(self.encoder, s.hidden_layers, input_ids=tokens.input_ids.to(self.device),
                               attention_mask=mask)
        records = []
        for i in range(len(captions)):
            states = hidden[i] if s.keep_padding else hidden[i][mask[i].bool()]
            states = states[s.drop_tokens:][: s.max_sequence_length]
            records.append({"hidden_states": states.to(self.dtype).cpu()})
        return records


def hidden_states(encoder: torch.nn.Module, layers: tuple[int, ...], **inputs: torch.Tensor) -> torch.Tensor:
    """The encoder's hidden states (B, L, D) of `layers`, concatenated per token, for inputs already
    on its device (token ids and mask; a vision-language encoder's image inputs too)."""
    import torch

    with torch.inference_mode():
        out = encoder(**inputs, output_hidden_states=True)
    return torch.cat([out.hidden_states[i] for i in layers], dim=-1)
