"""The tiny offline Qwen pieces the Qwen-based families share: a byte-level BPE tokenizer trained
with the `tokenizers` library on the bundled captions, with Qwen's special tokens and a chat
template, and the tiny Qwen3 text encoder config (Z-Image and Flux.2-klein; Qwen-Image builds its
Qwen2.5-VL around the same tokenizer).

The chat template is ours, written to render what Qwen3's own template renders for one user
message: `<|im_start|>user\\n{caption}<|im_end|>\\n<|im_start|>assistant\\n`, followed by an empty
`<think>\\n\\n</think>\\n\\n` block when `enable_thinking` is false (Flux.2-klein), nothing when it is
true or unset (Z-Image). The BPE trainer exhausts its merges on the small caption set, so its
output does not depend on the order it meets equal pairs in: the files are byte-identical when
rebuilt (tested).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

SEED = 0
CAPTIONS = Path(__file__).resolve().parents[2] / "assets" / "demo_images"
ENDOFTEXT = "<|endoftext|>"  # Qwen's pad, unk and eos
SPECIALS = ("<|im_start|>", "<|im_end|>", "<think>", "</think>",
            "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
TEXT_DIM = 16
TEXT_LAYERS = 28  # Flux.2-klein reads hidden layers 9, 18 and 27


def bpe_vocab_and_merges(captions: list[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE trained on `captions`, split into words as Qwen2Tokenizer splits them."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=1000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[ENDOFTEXT], show_progress=False)
    tokenizer.train_from_iterator(captions, trainer)
    model = json.loads(tokenizer.to_str())["model"]
    return model["vocab"], [tuple(pair) for pair in model["merges"]]


def qwen_tokenizer(named_tokens: dict[str, str] | None = None):
    """A Qwen2Tokenizer (byte-level BPE, Qwen's specials and chat template) from the bundled captions.
    `named_tokens`: specials also reachable by name (`image_token`), as processors look them up."""
    from transformers import Qwen2Tokenizer

    captions = [p.read_text().strip() for p in sorted(CAPTIONS.glob("*.txt"))]
    vocab, merges = bpe_vocab_and_merges(captions)
    named = {"model_specific_special_tokens": named_tokens} if named_tokens else {}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, additional_special_tokens=list(SPECIALS),
                               model_max_length=131072, **named)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def qwen3_config(vocab_size: int):
    from transformers import Qwen3Config

    return Qwen3Config(hidden_size=TEXT_DIM, intermediate_size=32, num_hidden_layers=TEXT_LAYERS,
                       num_attention_heads=2, num_key_value_heads=2, head_dim=8, vocab_size=vocab_size,
                       max_position_embeddings=1024, tie_word_embeddings=False)


def seeded(build, *args, **kwargs):
    """`build(...)` with torch's generator at SEED: random weights that are the same every build."""
    torch.manual_seed(SEED)
    return build(*args, **kwargs)
