"""Qwen-Image 2.1: a single-stream, block-causal flow-matching transformer on unpatched 64-channel
latents of a 16x VAE (one frame), conditioned on Qwen3-VL prompt embeddings of variable length.

As QwenImage21Pipeline does it: the caption in the pipeline's own system template (`TEMPLATE`),
tokenized with the processor's tokenizer, padded on the left to the batch's longest; Qwen3-VL's last
decoder layer's output before the language model's final norm (the pipeline hooks the norm away),
at the caption's own tokens, the system message's tokens dropped (as many as the tokenizer makes of
it), an empty caption read as " ". Records are stored unpadded and padded per batch with zeros and a
mask, dropped when nothing in the batch is padded (Qwen-Image's rule, which this pipeline keeps).
The VAE's records are (C, H/16, W/16), normalised per channel with latents_mean/latents_std. The
transformer reads the text and the latents as one sequence: `img_mask` marks one slot per 2x2 group
of latent tokens after the text, the timestep is sigma, the prediction is the sequence's image tail.

Exports: diffusers format, and ComfyUI's names under `diffusion_model.` (diffusers' module names,
except the MLP's gate and up projections, which the original checkpoint fuses into `gate_up`, gate
rows first, as diffusers' `convert_qwen_image21_transformer_checkpoint_to_diffusers` splits it).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from lorapipe.stages.lora_formats.original_names import OriginalNames

from .base import Components, Conditioning, Kohya, TextOptions, TextRecord
from .flow import FlowVariant, presets_field
from .folders import load_component
from .qwen_text import QwenPromptEncoder, QwenPromptSettings
from .qwenimage import QwenImage, linear_names, original_names

if TYPE_CHECKING:
    import torch

SYSTEM_MESSAGE = "<|im_start|>system\nComprehend and analyze the provided prompt.<|im_end|>\n"  # pipeline.sys_prompt
TEMPLATE = SYSTEM_MESSAGE + "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"  # prompt_template_t2i
PROCESSOR = "processor"  # the pipeline's Qwen3VLProcessor; its tokenizer is all text-to-image needs
BLOCK = r"transformer_blocks\.\d+\."
ATTENTION = (BLOCK + r"attn\.(to_q|to_k|to_v|to_out\.0)",)
FEED_FORWARD = (BLOCK + r"img_mlp\.(gate_layer|proj|out)",)
TIMESTEP_SCALE = 1000  # the pipeline's scheduler timesteps are 1000 sigma; the transformer reads t / 1000
FUSED_MLP = re.compile(r"\.img_mlp\.(gate_layer|proj)$")  # one `gate_up` in the original checkpoint
SLOT_TOKENS = 4  # latent tokens per image slot of img_mask (a 2x2 group)

VARIANTS = (FlowVariant("qwen-image-2.1", "qwen-image-2.1", 40, 4.0),)


class Qwen3VLPromptSettings(QwenPromptSettings):
    padding_side: Literal["left", "right"] = Field(description="the side a batch of captions is padded on,"
                                                   " which decides the positions the encoder sees")


class Qwen3VLPromptEncoder(QwenPromptEncoder):
    """QwenPromptEncoder on the processor's tokenizer, reading the last decoder layer's output
    before the language model's final norm, as QwenImage21Pipeline's forward hook makes it."""

    def __init__(self, model_path: Path, settings: Qwen3VLPromptSettings, dtype: torch.dtype, device: str):
        self.settings, self.dtype, self.device = settings, dtype, device
        self.tokenizer = processor_tokenizer(model_path, padding_side=settings.padding_side)
        self.encoder = load_component(model_path, "text_encoder").eval().requires_grad_(False).to(device)

    def templated(self, caption: str) -> str:
        return super().templated(caption or " ")  # the pipeline's: with no bos token, "" leaves nothing to read

    def __call__(self, captions: list[str]) -> list[TextRecord]:
        language_model = getattr(self.encoder.model, "language_model", self.encoder.model)
        handle = language_model.norm.register_forward_hook(lambda module, args, output: args[0])
        try:
            return super().__call__(captions)
        finally:
            handle.remove()


def system_message_ids(model_path: Path) -> list[int]:
    """The system message's tokens, by the processor's tokenizer.json through `tokenizers` (what
    transformers' fast tokenizer runs) without importing transformers: encode's key counts them,
    and a run served wholly from the cache imports no model code."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(model_path) / PROCESSOR / "tokenizer.json")).encode(SYSTEM_MESSAGE).ids


def processor_tokenizer(model_path: Path, **kwargs: Any) -> Any:
    """The processor's tokenizer alone (its image and video processors are not needed for text)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path, subfolder=PROCESSOR, **kwargs)


@dataclass(frozen=True)
class QwenImage21(QwenImage):
    variants: tuple[FlowVariant, ...] = VARIANTS
    lora_presets: dict[str, tuple[str, ...]] = presets_field(ATTENTION, FEED_FORWARD, (BLOCK,))

    # ---- text
    def text_settings(self, model_path: Path, options: TextOptions) -> Qwen3VLPromptSettings:
        length = self.text_length(options)
        system_tokens = len(system_message_ids(model_path))
        return Qwen3VLPromptSettings(system_template=TEMPLATE, hidden_layers=(-1,), max_sequence_length=length,
                                     token_window=length + system_tokens, pad_to_window=False, keep_padding=False,
                                     drop_tokens=system_tokens, padding_side="left")

    # ---- denoiser
    def predict(self, transformer: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                conditioning: Conditioning, dtype: torch.dtype) -> torch.Tensor:
        """As QwenImage21Pipeline calls its transformer: latents flattened (unpatched) after the
        text, img_mask marking their slots, t / 1000, the frame's shape in tokens; the sequence's
        image tail unflattened."""
        import torch
        from diffusers import QwenImage21Pipeline as Pipe

        b, c, h, w = noisy.shape
        text, mask = conditioning["encoder_hidden_states"], conditioning.get("encoder_hidden_states_mask")
        img_mask = torch.cat([torch.zeros(b, text.shape[1], dtype=torch.bool),
                              torch.ones(b, h * w // SLOT_TOKENS, dtype=torch.bool)], dim=1)
        out = transformer(
            hidden_states=Pipe._pack_latents(noisy, b, c, h, w).to(dtype),
            timestep=(timesteps * TIMESTEP_SCALE).to(dtype) / TIMESTEP_SCALE,
            encoder_hidden_states=text.to(device=noisy.device, dtype=dtype),
            encoder_hidden_states_mask=None if mask is None else mask.to(noisy.device),
            img_shapes=[[(1, h, w)]] * b, img_mask=img_mask.to(noisy.device), return_dict=False)[0]
        return Pipe._unpack_latents(out[:, -h * w:], h, w, 1).squeeze(2).float()

    # ---- LoRA
    def original_names(self, transformer: torch.nn.Module) -> OriginalNames:
        """The converter's names, read with the original checkpoint's keys: its fused `gate_up`."""
        return original_names(tuple(sorted({FUSED_MLP.sub(".img_mlp.gate_up", name)
                                            for name in linear_names(transformer)})))

    # ---- rendering
    def render_kwargs(self, settings: Qwen3VLPromptSettings, guidance_scale: float,
                      negative_prompt: str) -> dict[str, Any]:
        return {"true_cfg_scale": guidance_scale, "negative_prompt": negative_prompt or " "}

    # ---- tiny model
    def build_tiny_variant(self, out_dir: Path, variant: FlowVariant) -> Path:
        from .tiny.qwenimage21 import build_tiny_qwenimage21

        return build_tiny_qwenimage21(out_dir)


QWEN_IMAGE_21 = QwenImage21(
    name="qwen-image-2.1", label="Qwen-Image 2.1", pipeline_class="QwenImage21Pipeline",
    components=Components(text=("text_encoder", PROCESSOR), latent=("vae",), denoiser="transformer"),
    kohya=Kohya("qwen_image_2_1"), latent_patch=2, text_encoder=Qwen3VLPromptEncoder,
    single_file_markers=("transformer_blocks.0.img_mlp.gate_up.weight",  # ComfyUI's fused gate and up, bare or prefixed
                         "model.diffusion_model.transformer_blocks.0.img_mlp.gate_up.weight"),
    block_lists=("transformer_blocks",),
)
