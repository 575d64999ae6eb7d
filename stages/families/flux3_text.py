"""FLUX.3's text records, as its text block (diffusers' Flux3TextEncoderStep) computes them: the
caption in the processor's chat template, right-padded to a window that is its own token count
rounded up to a multiple of PAD_MULTIPLE (at most max_sequence_length), the pad tokens at position 1
(the transformers version FLUX.3 was trained with), hidden layers concatenated per token. Every
position is kept: the transformer takes no text mask and attends to the pad rows, so a record holds
them, and each caption has its own window (padding a batch to its longest would change the
prediction).
"""
from __future__ import annotations

import math

from .base import TextRecord
from .qwen_text import QwenPromptEncoder, hidden_states

PAD_MULTIPLE = 80  # Flux3TextEncoderStep's pad_multiple


class Flux3PromptEncoder(QwenPromptEncoder):
    """Captions -> records {"hidden_states": (window, D)}, one caption at a time (windows differ).
    The tokenizer component is a processor: its chat template, its tokenizer's ids."""

    def __call__(self, captions: list[str]) -> list[TextRecord]:
        return [self.record(caption) for caption in captions]

    def too_long(self, caption: str) -> bool:
        return len(self.tokenizer.tokenizer(self.templated(caption)).input_ids) > self.settings.max_sequence_length

    def record(self, caption: str) -> TextRecord:
        import torch

        limit, text = self.settings.max_sequence_length, self.templated(caption)
        length = len(self.tokenizer.tokenizer(text, truncation=True, max_length=limit).input_ids)
        window = min(math.ceil(length / PAD_MULTIPLE) * PAD_MULTIPLE, limit)
        tokens = self.tokenizer.tokenizer(text, padding="max_length", padding_side="right", truncation=True,
                                          max_length=window, return_tensors="pt")
        mask = tokens.attention_mask.to(self.device)
        positions = torch.arange(window, device=self.device)[None].masked_fill(mask == 0, 1)
        states = hidden_states(self.encoder, self.settings.hidden_layers, input_ids=tokens.input_ids.to(self.device),
                               attention_mask=mask, position_ids=positions)
        return {"hidden_states": states[0].to(self.dtype).cpu()}
