"""Florence-2 as a captioner: transformers' own Florence2ForConditionalGeneration and Florence2Processor,
called as their documented usage calls them. The prompt is a task token (`<MORE_DETAILED_CAPTION>`) or
plain text, and the processor turns it into the model's input (a task token becomes its question, plain
text goes in as it is); generate() runs with the checkpoint's generation config (forced BOS/EOS, no
repeated trigrams) and the stage's settings (three beams by default, as the documented usage;
greedy unless sampling); each row is decoded with its special tokens
and cleaned by the processor's post_process_generation, which for a caption task removes `<s>`/`</s>`
and strips the text.

Batched rows that end before the longest carry padding after their EOS, which post_process_generation
leaves in the text (it expects one image at a time): it is cut off before decoding, so a caption reads
as the same image captioned alone.
"""
from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image

from lorapipe.cache.errors import UserError

DEFAULT_PROMPT = "<MORE_DETAILED_CAPTION>"
DEFAULT_NUM_BEAMS = 3  # Florence-2's documented usage: generate(..., num_beams=3)
CAPTION_TASK_TYPE = "pure_text"  # the processor's post-processing type of its caption tasks


class FlorenceCaptioner:
    """(images, prompt) -> one caption per image, from a local Florence-2 folder."""

    def __init__(self, model_path: Path, generation: dict, dtype: torch.dtype, device: str):
        """`generation`: generate()'s arguments (max_new_tokens, do_sample, num_beams, ...)."""
        from transformers import AutoProcessor, Florence2ForConditionalGeneration

        self.model = Florence2ForConditionalGeneration.from_pretrained(model_path, dtype=dtype).to(device).eval()
        self.processor = AutoProcessor.from_pretrained(model_path)
        self.generation = generation
        self.device, self.dtype = device, dtype

    def __call__(self, images: list[Image.Image], prompt: str) -> list[str]:
        self._check_caption_task(prompt)
        inputs = self.processor(text=[prompt] * len(images), images=images, return_tensors="pt")
        with torch.inference_mode():
            generated = self.model.generate(**inputs.to(self.device, self.dtype), **self.generation)
        return [self._caption(row, prompt, image.size) for row, image in zip(generated, images)]

    def _check_caption_task(self, prompt: str):
        task_type = self.processor.tasks_answer_post_processing_type.get(prompt, CAPTION_TASK_TYPE)
        if task_type != CAPTION_TASK_TYPE:
            raise UserError(f"caption.prompt: {prompt} is a Florence-2 {task_type} task, not a caption: use "
                            f"<CAPTION>, <DETAILED_CAPTION>, {DEFAULT_PROMPT} or plain text")
        try:
            self.processor(text=[prompt])  # the processor's own check of the task token
        except ValueError as error:  # a task token with more text after it
            raise UserError(f"caption.prompt: {error}") from None

    def _caption(self, row: torch.Tensor, prompt: str, image_size: tuple[int, int]) -> str:
        pad = self.model.generation_config.pad_token_id
        length = int((row != pad).nonzero().max()) + 1  # the row without the padding batching added
        text = self.processor.decode(row[:length], skip_special_tokens=False)
        return self.processor.post_process_generation(text, task=prompt, image_size=image_size)[prompt]
