"""Flux.2-dev (32B): Flux.2-klein's transformer with a guidance input, conditioned on stacked
hidden states of Mistral Small 3 (Mistral3ForConditionalGeneration), rendered by Flux2Pipeline.

As Flux2Pipeline.encode_prompt does it: the caption (its `[IMG]` markers removed) as a user
message of one text part after the pipeline's system message, in the processor's chat template
(which writes the bos itself, so the tokens are added without special tokens, as the processor's
apply_chat_template adds them), padded to max_sequence_length (512); hidden layers 10, 20 and 30
concatenated per token, every position kept. Only the processor's tokenizer is loaded: text-to-image
reads nothing else of it. The system message and the layers are text settings, in the record's key.

Everything else is Klein's (flux2.py): the batch-norm normalised, 2x2-patchified latents, the
empirical-mu shift, the denoiser call, edit pairs' references (up to ten: Flux2Pipeline(image=[...])
encodes and places them as Klein's pipeline does), the presets and the exports in BFL's names; the denoiser
also reads train.guidance (Flux2Pipeline passes its guidance_scale; the transformer scales it by
1000 itself), which the family puts into the conditioning as Flux.1 dev does.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from lorapipe.stages.lora_formats.original_names import COMFYUI, KOHYA

from .base import Components, Kohya, TextOptions
from .flow import FlowVariant, refuse_negative_prompt
from .flux2 import FLUX2_KLEIN, Flux2Klein
from .qwen_text import QwenPromptEncoder, QwenPromptSettings

if TYPE_CHECKING:
    import torch

HIDDEN_LAYERS = (10, 20, 30)  # Flux2Pipeline's text_encoder_out_layers
# pipelines/flux2/system_messages.py's SYSTEM_MESSAGE, written out: encode's key reads it without diffusers
SYSTEM_MESSAGE = ("You are an AI that reasons about image descriptions. You give structured responses focusing on"
                  " object relationships, object\nattribution and actions without speculation.")
IMAGE_MARKER = "[IMG]"  # format_input removes it from prompts: the processor would count it as an image token

MAX_REFERENCES = 10  # what BFL's FLUX.2 overview gives for multi-reference editing; the pipeline sets no bound
VARIANTS = (FlowVariant("dev", "flux2-dev", 50, 4.0, guidance_embeds=True),)  # BFL's model card: 50 steps, 4


class MistralPromptSettings(QwenPromptSettings):
    system_message: str = Field(description="the pipeline's system message, before the caption")


class MistralPromptEncoder(QwenPromptEncoder):
    """Captions -> records {"hidden_states": (max_sequence_length, 3 x D)}, as Flux2Pipeline encodes them."""

    add_special_tokens = False

    def __init__(self, model_path: Path, settings: MistralPromptSettings, dtype: torch.dtype, device: str):
        from transformers import AutoTokenizer

        from .folders import load_component

        self.settings, self.dtype, self.device = settings, dtype, device
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, subfolder="tokenizer")  # the processor's
        self.encoder = load_component(model_path, "text_encoder").eval().requires_grad_(False).to(device)

    def templated(self, caption: str) -> str:
        messages = [{"role": "system", "content": [{"type": "text", "text": self.settings.system_message}]},
                    {"role": "user", "content": [{"type": "text", "text": caption.replace(IMAGE_MARKER, "")}]}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)


@dataclass(frozen=True)
class Flux2Dev(Flux2Klein):
    variants: tuple[FlowVariant, ...] = VARIANTS

    # ---- text
    def text_settings(self, model_path: Path, options: TextOptions) -> MistralPromptSettings:
        length = self.text_length(options)
        return MistralPromptSettings(system_message=SYSTEM_MESSAGE, hidden_layers=HIDDEN_LAYERS,
                                     max_sequence_length=length, token_window=length, pad_to_window=True,
                                     keep_padding=True)

    # ---- rendering
    def render_kwargs(self, settings: MistralPromptSettings, guidance_scale: float,
                      negative_prompt: str) -> dict[str, Any]:
        refuse_negative_prompt(negative_prompt, "Flux.2-dev is guidance-distilled and takes no negative prompt")
        return {"guidance_scale": guidance_scale, "max_sequence_length": settings.max_sequence_length,
                "text_encoder_out_layers": settings.hidden_layers}

    # ---- tiny model
    def build_tiny_variant(self, out_dir: Path, variant: FlowVariant) -> Path:
        from .tiny.flux2_dev import build_tiny_flux2_dev

        return build_tiny_flux2_dev(out_dir)


FLUX2_DEV = Flux2Dev(
    name="flux2-dev", label="Flux.2-dev", pipeline_class="Flux2Pipeline", components=FLUX2_KLEIN.components,
    kohya=Kohya("flux2_dev"), latent_patch=2, text_encoder=MistralPromptEncoder, sequence_patch=1,
    original_formats=(KOHYA, COMFYUI), block_lists=FLUX2_KLEIN.block_lists, max_references=MAX_REFERENCES,
)
