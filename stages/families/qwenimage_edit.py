"""Qwen-Image-Edit and Qwen-Image-Edit-Plus (2509, 2511): Qwen-Image's transformer and VAE, editing
reference images by an instruction.

As QwenImageEditPipeline / QwenImageEditPlusPipeline do it: the processor reads the instruction in
the pipeline's own system template together with the reference images, each resized to a fixed
area at its own aspect ratio (sides multiples of 32: the Edit pipeline's 1024 x 1024, Plus's
condition images' 384 x 384); Plus names each image in the user message ("Picture 1: ..."), the
Edit template holds its one image itself. Qwen2.5-VL's last hidden state at every token of the
prompt, its first 64 (the template's system prefix) dropped, nothing truncated: records are stored
unpadded and padded per batch as Qwen-Image's. The denoiser reads each reference's latents packed
after the noisy ones, as a frame of its own (Qwen-Image's predict); only the noisy tokens'
prediction is the model's.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from lorapipe.stages.contract import Frozen

from .base import Components, Kohya, TextOptions, TextRecord
from .flow import FlowVariant
from .folders import load_component
from .qwen_text import hidden_states
from .qwenimage import QwenImage

if TYPE_CHECKING:
    import torch

TEMPLATE = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects,"
            " background), then explain how the user's text instruction should alter or modify the image. Generate a"
            " new image that meets the user's requirements while maintaining consistency with the original input"
            " where appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"  # the processor expands the pad to the image's tokens
PICTURE = "Picture {}: " + IMAGE  # Plus: QwenImageEditPlusPipeline's img_prompt_template
TEMPLATE_PREFIX_TOKENS = 64  # the pipelines' prompt_template_encode_start_idx
EDIT_AREA = 1024 * 1024  # QwenImageEditPipeline's image area, for the encoder as for the VAE
CONDITION_AREA = 384 * 384  # QwenImageEditPlusPipeline.CONDITION_IMAGE_SIZE
PROCESSOR = "processor"


class QwenEditPromptSettings(Frozen):
    system_template: str = Field(description="the pipeline's template, '{}' the user message")
    picture_template: str | None = Field(description="each image's part of the user message, '{}' its number"
                                         " (Plus); None: the template holds the one image")
    image_area: int = Field(gt=0, description="pixels the encoder reads each reference image at")
    drop_tokens: int = Field(ge=0, description="template tokens dropped from the record's start")


class QwenEditPromptEncoder:
    """(captions, their reference images) -> records {"hidden_states": (L, D)}, each caption encoded
    with its own images as the pipeline's encode_prompt encodes one prompt."""

    def __init__(self, model_path: Path, settings: QwenEditPromptSettings, dtype: torch.dtype, device: str):
        self.settings, self.dtype, self.device = settings, dtype, device
        self.processor = load_component(model_path, PROCESSOR)
        self.encoder = load_component(model_path, "text_encoder").eval().requires_grad_(False).to(device)

    def too_long(self, caption: str) -> bool:
        return False  # the pipelines truncate nothing

    def templated(self, caption: str, images: int) -> str:
        s = self.settings
        pictures = "" if s.picture_template is None else "".join(s.picture_template.format(i + 1) for i in range(images))
        return s.system_template.format(pictures + caption)

    def resized(self, image: Any) -> Any:
        """The image as the pipeline hands it to the processor: at image_area, its aspect ratio kept."""
        from diffusers.image_processor import VaeImageProcessor
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

        width, height = calculate_dimensions(self.settings.image_area, image.width / image.height)
        return VaeImageProcessor().resize(image, height, width)

    def __call__(self, captions: list[str], references: list[list[Any]] | None = None) -> list[TextRecord]:
        references = references or [[] for _ in captions]
        for caption, images in zip(captions, references):
            if not images:  # neither pipeline encodes a prompt without an image
                raise ValueError(f"Qwen-Image-Edit reads each instruction with its reference image(s): {caption!r}"
                                 " has none")
        return [self.record(caption, images) for caption, images in zip(captions, references)]

    def record(self, caption: str, images: list[Any]) -> TextRecord:
        inputs = self.processor(text=[self.templated(caption, len(images))], images=[self.resized(i) for i in images],
                                padding=True, return_tensors="pt").to(self.device)
        mask = inputs["attention_mask"]
        states = hidden_states(self.encoder, (-1,), input_ids=inputs["input_ids"], attention_mask=mask,
                               pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"])
        return {"hidden_states": states[0][mask[0].bool()][self.settings.drop_tokens:].to(self.dtype).cpu()}


@dataclass(frozen=True)
class QwenImageEdit(QwenImage):
    text_takes_references: bool = True
    renders_without_references: bool = False  # its encode_prompt needs an image
    demo_edits: bool = True
    picture_template: str | None = None  # Plus names each image in the user message
    image_area: int = EDIT_AREA  # what the pipeline resizes a reference to for the text encoder

    # ---- text
    def text_settings(self, model_path: Path, options: TextOptions) -> QwenEditPromptSettings:
        if options.max_sequence_length is not None:
            raise ValueError(f"encode.max_sequence_length: {self.label}'s pipeline reads the whole instruction and"
                             " its images; remove it")
        return QwenEditPromptSettings(system_template=TEMPLATE if self.picture_template else TEMPLATE.format(IMAGE + "{}"),
                                      picture_template=self.picture_template, image_area=self.image_area,
                                      drop_tokens=TEMPLATE_PREFIX_TOKENS)

    # ---- rendering
    def render_kwargs(self, settings: QwenEditPromptSettings, guidance_scale: float,
                      negative_prompt: str) -> dict[str, Any]:
        return {"true_cfg_scale": guidance_scale, "negative_prompt": negative_prompt or " "}

    def reference_render_kwargs(self, images: list[Any]) -> dict[str, Any]:
        return {"image": images if self.picture_template else images[0]}

    # ---- tiny model
    def build_tiny_variant(self, out_dir: Path, variant: FlowVariant) -> Path:
        from .tiny.qwenimage_edit import build_tiny_qwenimage_edit

        return build_tiny_qwenimage_edit(out_dir, self.pipeline_class)


def edit_family(name: str, label: str, pipeline_class: str, variant: FlowVariant, **edit: Any) -> QwenImageEdit:
    return QwenImageEdit(
        name=name, label=label, pipeline_class=pipeline_class, variants=(variant,),
        components=Components(text=("text_encoder", PROCESSOR), latent=("vae",), denoiser="transformer"),
        kohya=Kohya(name.replace("-", "_")), latent_patch=2, text_encoder=QwenEditPromptEncoder,
        block_lists=("transformer_blocks",), **edit,
    )


QWEN_IMAGE_EDIT = edit_family("qwen-image-edit", "Qwen-Image-Edit", "QwenImageEditPipeline",
                              FlowVariant("qwen-image-edit", "qwen-image-edit", 50, 4.0), max_references=1)
# Plus's pipeline takes any number of images; Qwen-Image-Edit-2509 was trained on one to three
QWEN_IMAGE_EDIT_PLUS = edit_family("qwen-image-edit-plus", "Qwen-Image-Edit-Plus", "QwenImageEditPlusPipeline",
                                   FlowVariant("qwen-image-edit-plus", "qwen-image-edit-plus", 40, 4.0),
                                   max_references=3, picture_template=PICTURE, image_area=CONDITION_AREA)
