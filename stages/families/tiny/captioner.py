"""A tiny Qwen2.5-VL captioner built offline, byte-for-byte reproducible: the tiny Qwen-Image's
Qwen2.5-VL (2-layer language model, 2-layer vision tower, random weights from a seed) and its
processor, saved as a transformers folder (config.json `model_type: qwen2_5_vl`) for the caption
stage's tests and `lorapipe demo --caption`. Its captions are nonsense; what it exercises is real:
the chat template with an image, the processor's image tokens, batched generate() and decoding.

The processor's chat template is ours, rendering one user message as Qwen2-VL's own does:
`<|im_start|>user\\n<|vision_start|><|image_pad|><|vision_end|>{prompt}<|im_end|>\\n`, then
`<|im_start|>assistant\\n`.

Its weight matrices (all but the embeddings) are scaled by WEIGHT_SCALE: at the seed's small
initial weights every image got nearly the same caption, while the tests count captions that must
differ from image to image (a new caption, one new text record).
"""
from __future__ import annotations

from pathlib import Path

from .qwen import qwen_tokenizer, seeded
from .qwenimage import tiny_qwen25vl, vl_processor

WEIGHT_SCALE = 16.0

VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tiny_captioner(out_dir: Path) -> Path:
    tokenizer = qwen_tokenizer({"image_token": "<|image_pad|>"})
    processor = vl_processor(tokenizer)
    processor.chat_template = VL_CHAT_TEMPLATE
    out_dir = Path(out_dir)
    _image_dependent(seeded(tiny_qwen25vl, tokenizer)).save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return out_dir


def _image_dependent(model):
    import torch

    with torch.no_grad():
        for name, weight in model.named_parameters():
            if weight.dim() > 1 and "embed" not in name:
                weight.mul_(WEIGHT_SCALE)
    return model
