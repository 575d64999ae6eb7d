"""The tiny CLIP text encoder and its byte-level tokenizer, written from scratch, that the tiny SD
models and the tiny Flux.1 share: random weights from a fixed seed.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

SEED = 0
TEXT_DIM = 32


def _byte_level_vocab() -> dict[str, int]:
    """CLIP's byte-to-unicode alphabet, each symbol alone and word-final, plus the specials."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            codes.append(256 + extra)
            extra += 1
    symbols = [chr(c) for c in codes]
    tokens = symbols + [s + "</w>" for s in symbols] + ["<|startoftext|>", "<|endoftext|>"]
    return {tok: i for i, tok in enumerate(tokens)}


def write_tokenizer(out_dir: Path):
    from transformers import CLIPTokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "vocab.json").write_text(json.dumps(_byte_level_vocab(), ensure_ascii=False))
    (out_dir / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(out_dir / "vocab.json"), str(out_dir / "merges.txt"), model_max_length=77)
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def clip_text_encoder(with_projection: bool, positions: int = 77, projection_dim: int = TEXT_DIM):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        hidden_size=TEXT_DIM, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2,
        vocab_size=len(_byte_level_vocab()), max_position_embeddings=positions, projection_dim=projection_dim,
        bos_token_id=len(_byte_level_vocab()) - 2, eos_token_id=len(_byte_level_vocab()) - 1,
        pad_token_id=len(_byte_level_vocab()) - 1,
    )
    torch.manual_seed(SEED)
    return (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(config)
