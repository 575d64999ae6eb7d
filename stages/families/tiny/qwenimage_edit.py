"""A tiny Qwen-Image-Edit (or Edit-Plus) built offline, byte-for-byte reproducible: `lorapipe
tiny-model DIR --arch qwen-image-edit` (or `qwen-image-edit-plus`).

Qwen-Image's tiny transformer, VAE and Qwen2.5-VL (its vision tower reads the reference images),
plus the processor the edit pipelines call with the prompt and the images (qwenimage.vl_processor).
"""
from __future__ import annotations

from pathlib import Path

from .qwen import qwen_tokenizer
from .qwenimage import tiny_qwenimage_parts, vl_processor


def build_tiny_qwenimage_edit(out_dir: Path, pipeline_class: str) -> Path:
    import diffusers

    tokenizer = qwen_tokenizer({"image_token": "<|image_pad|>"})
    pipe = getattr(diffusers, pipeline_class)(**tiny_qwenimage_parts(tokenizer), processor=vl_processor(tokenizer))
    pipe.save_pretrained(Path(out_dir), safe_serialization=True)
    return Path(out_dir)
