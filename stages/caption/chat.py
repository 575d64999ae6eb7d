"""The Qwen2-VL / Qwen2.5-VL captioner, as the models' documented usage runs them: one user message
of the image and the prompt through the processor's chat template, a batch left-padded, generate()
with the stage's generation settings (greedy, one beam, unless set otherwise), the prompt's tokens cut off and special tokens skipped in decoding."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from lorapipe.cache.errors import UserError

if TYPE_CHECKING:
    from PIL import Image

DEFAULT_PROMPT = "Describe this image in one sentence."
DEFAULT_NUM_BEAMS = 1  # the models' documented usage: greedy


class ChatCaptioner:
    def __init__(self, model_path: Path, generation: dict, dtype, device: str):
        """`generation`: generate()'s arguments (max_new_tokens, do_sample, num_beams, ...)."""
        from transformers import AutoModelForImageTextToText, AutoProcessor

        try:
            self.processor = AutoProcessor.from_pretrained(model_path)
        except ImportError as missing:  # Qwen2-VL's processor builds its video processor, which needs torchvision
            reason = " ".join(str(missing).split()).split(". ")[0]
            raise UserError(f"caption.model: {model_path}: its processor cannot be loaded: {reason}"
                            " (pip install torchvision)") from None
        self.processor.tokenizer.padding_side = "left"  # generation continues every row from its last token
        self.model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=dtype).to(device).eval()
        self.generation = generation

    def inputs(self, images: list[Image.Image], prompt: str):
        """The processor's batch for `images`, each asked `prompt`."""
        message = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
        text = self.processor.apply_chat_template(message, tokenize=False, add_generation_prompt=True)
        batch = self.processor(text=[text] * len(images), images=images, padding=True, return_tensors="pt")
        return batch.to(self.model.device)

    def __call__(self, images: list[Image.Image], prompt: str) -> list[str]:
        import torch

        batch = self.inputs(images, prompt)
        with torch.inference_mode():
            generated = self.model.generate(**batch, **self.generation)
        new_tokens = generated[:, batch["input_ids"].shape[1]:]
        return [text.strip() for text in self.processor.batch_decode(new_tokens, skip_special_tokens=True)]
