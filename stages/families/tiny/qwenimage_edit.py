"""A tiny Qwen-Image-Edit (or Edit-Plus) built offline, byte-for-byte reproducible: `lorapipe
tiny-model DIR --arch qwen-image-edit` (or `qwen-image-edit-plus`).

Qwen-Image's tiny transformer, VAE and Qwen2.5-VL (its vision tower reads the reference images),
plus the processor the edit pipelines call with the prompt and the images. transformers builds no
Qwen2VLProcessor without torchvision (its video processor needs it, even for images), so the
processor is a PaddleOCRVLProcessor: the same image-token expansion (one `<|image_pad|>` per merged
2x2 patch of `image_grid_thw`) around Qwen2-VL's image processor, built and loaded without
torchvision. Its image processor reads at most 64 merged patches per image (the real one reads up
to 16384), which keeps the tiny model's text encoding fast.
"""
from __future__ import annotations

from pathlib import Path

from .qwen import qwen_tokenizer
from .qwenimage import tiny_qwenimage_parts

MAX_PIXELS = 64 * 28 * 28  # 64 merged patches of 28 x 28 pixels


def _processor(tokenizer):
    from transformers import PaddleOCRVLProcessor, Qwen2VLImageProcessorPil

    return PaddleOCRVLProcessor(image_processor=Qwen2VLImageProcessorPil(max_pixels=MAX_PIXELS), tokenizer=tokenizer)


def build_tiny_qwenimage_edit(out_dir: Path, pipeline_class: str) -> Path:
    import diffusers

    tokenizer = qwen_tokenizer({"image_token": "<|image_pad|>"})
    pipe = getattr(diffusers, pipeline_class)(**tiny_qwenimage_parts(tokenizer), processor=_processor(tokenizer))
    pipe.save_pretrained(Path(out_dir), safe_serialization=True)
    return Path(out_dir)
