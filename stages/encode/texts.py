"""Text records: each model family's prompt embedding, for captions not yet in the store."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..contract import Log
from ..encoded import encode_record

if TYPE_CHECKING:
    import torch


class TextEncoder:
    """The model family's prompt encoder: SD1.x/2.x last hidden state; SDXL both encoders'
    penultimate hidden states concatenated, plus the second encoder's pooled embedding."""

    def __init__(self, model_path: Path, family: str, dtype: torch.dtype, device: str = "cpu"):
        from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

        self.family, self.dtype, self.device = family, dtype, device
        load_tok = lambda sub: CLIPTokenizer.from_pretrained(model_path, subfolder=sub)  # noqa: E731
        self.pairs = [(load_tok("tokenizer"), CLIPTextModel.from_pretrained(model_path, subfolder="text_encoder"))]
        if family == "sdxl":
            self.pairs.append((load_tok("tokenizer_2"), CLIPTextModelWithProjection.from_pretrained(
                model_path, subfolder="text_encoder_2")))
        for _, model in self.pairs:
            model.eval().requires_grad_(False).to(device)

    def too_long(self, caption: str) -> bool:
        tokenizer = self.pairs[0][0]
        return len(tokenizer(caption).input_ids) > tokenizer.model_max_length

    def __call__(self, captions: list[str]) -> list[dict[str, torch.Tensor]]:
        import torch

        hidden, pooled = [], None
        for tokenizer, model in self.pairs:
            ids = tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length,
                            truncation=True, return_tensors="pt").input_ids.to(self.device)
            with torch.inference_mode():
                out = model(ids, output_hidden_states=True)
            hidden.append(out.hidden_states[-2] if self.family == "sdxl" else out.last_hidden_state)
            if self.family == "sdxl" and hasattr(out, "text_embeds"):  # the projection encoder
                pooled = out.text_embeds
        states = torch.cat(hidden, dim=-1).to(self.dtype)
        records = [{"hidden_states": states[i]} for i in range(len(captions))]
        if pooled is not None:
            for i, r in enumerate(records):
                r["pooled"] = pooled[i].to(self.dtype)
        return records


def encode_texts(jobs: list[tuple[str, str, str]], encoder: Callable[[], TextEncoder],
                 add: Callable[[str, dict[str, bytes]], None], batch_size: int, log: Log) -> None:
    """jobs: (text record key, caption, whose caption) for texts not yet in the store."""
    if not jobs:
        return
    text_encoder = encoder()
    for _, caption, whose in jobs:
        if text_encoder.too_long(caption):
            log(f"encode: warning: the caption of {whose} is longer than the text encoder's window; it is truncated")
    for start in range(0, len(jobs), batch_size):
        batch = jobs[start:start + batch_size]
        for (key, caption, _), tensors in zip(batch, text_encoder([c for _, c, _ in batch])):
            add(key, encode_record(tensors, {"caption": caption}))
