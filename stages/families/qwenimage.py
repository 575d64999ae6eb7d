"""Qwen-Image: a double-stream flow-matching transformer on 2x2-packed 16-channel latents of a video
VAE (one frame), conditioned on Qwen2.5-VL prompt embeddings of variable length.

As QwenImagePipeline does it: the caption in the pipeline's own system template (`TEMPLATE`),
tokenized padded to the batch's longest (at most 1024 + 34 tokens), Qwen2.5-VL's last hidden state
at the caption's own tokens, the template's first 34 tokens (its system prefix) dropped, at most
max_sequence_length (512) kept: records are stored unpadded (L_i, 3584 at full size) and padded per
batch with zeros and a mask, which is dropped when no record in the batch is padded (the pipeline's
rule). The VAE encodes one frame: its records are (16, H/8, W/8), normalised per channel with the
config's latents_mean/latents_std; the transformer reads sigma (t / 1000) and image shapes.

Exports: diffusers format, and ComfyUI's native names under `diffusion_model.`: Qwen-Image's original
checkpoint is in diffusers' layout, so its names are the diffusers module names, as diffusers'
`convert_qwen_image21_transformer_checkpoint_to_diffusers` maps them (1:1 for this model; only
Qwen-Image 2.1 fuses its MLP's gate and up).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from lorapipe.stages.lora_formats.original_names import OriginalNames, derive_original_names

from .base import (REFERENCE_LATENTS, Components, Conditioning, ImageGeometry, Kohya, TextOptions, TextRecord,
                   pad_sequences)
from .flow import FlowFamily, FlowVariant, presets_field
from .latents import ONE_FRAME, ChannelMeanStd, VaePosterior, channel_mean_std_of
from .objectives import ObjectiveParams
from .qwen_text import QwenPromptEncoder, QwenPromptSettings

if TYPE_CHECKING:
    import torch

TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text,"
            " spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
            "<|im_start|>assistant\n")  # QwenImagePipeline.prompt_template_encode
TEMPLATE_PREFIX_TOKENS = 34  # QwenImagePipeline.prompt_template_encode_start_idx
MAX_TOKENS = 1024  # QwenImagePipeline.tokenizer_max_length; it refuses a longer max_sequence_length
BLOCK = r"transformer_blocks\.\d+\."
ATTENTION = (BLOCK + r"attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)",)
FEED_FORWARD = (BLOCK + r"(img_mlp|txt_mlp)\.net\.(0\.proj|2)",)
TIMESTEP_SCALE = 1000  # the pipeline's scheduler timesteps are 1000 sigma; the transformer reads t / 1000

VARIANTS = (FlowVariant("qwen-image", "qwen-image", 50, 4.0),)


@dataclass(frozen=True)
class QwenImage(FlowFamily):
    variants: tuple[FlowVariant, ...] = VARIANTS
    latent_encoder: Callable[[Path, str, str], VaePosterior] = ONE_FRAME  # a video VAE, one frame
    normalisation_of: Callable[[Path, str], ChannelMeanStd] = channel_mean_std_of
    lora_presets: dict[str, tuple[str, ...]] = presets_field(ATTENTION, FEED_FORWARD, (BLOCK,))

    # ---- text
    def text_settings(self, model_path: Path, options: TextOptions) -> QwenPromptSettings:
        length = self.text_length(options)
        if length > MAX_TOKENS:
            raise ValueError(f"encode.max_sequence_length: Qwen-Image reads at most {MAX_TOKENS} tokens, not {length}")
        return QwenPromptSettings(system_template=TEMPLATE, hidden_layers=(-1,), max_sequence_length=length,
                                  token_window=MAX_TOKENS + TEMPLATE_PREFIX_TOKENS, pad_to_window=False,
                                  keep_padding=False, drop_tokens=TEMPLATE_PREFIX_TOKENS)

    # ---- denoiser
    def conditioning(self, texts: list[TextRecord], images: list[tuple[ImageGeometry, bool]],
                     params: ObjectiveParams) -> Conditioning:
        embeds, mask = pad_sequences(texts, "hidden_states")
        return {"encoder_hidden_states": embeds} if mask.all() else \
            {"encoder_hidden_states": embeds, "encoder_hidden_states_mask": mask}

    def predict(self, transformer: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                conditioning: Conditioning, dtype: torch.dtype) -> torch.Tensor:
        """As the Qwen-Image pipelines call their transformer: latents packed 2x2, an edit pair's
        reference latents packed after them (each its own frame of img_shapes), t / 1000, the padded
        text and its mask; the noisy latents' prediction unpacked."""
        import torch
        from diffusers import QwenImagePipeline as Pipe

        b, c, h, w = noisy.shape
        references = conditioning.get(REFERENCE_LATENTS)
        frames = [noisy, *([] if references is None else references.unbind(1))]
        mask = conditioning.get("encoder_hidden_states_mask")
        out = transformer(
            hidden_states=torch.cat([Pipe._pack_latents(f, b, c, *f.shape[-2:]) for f in frames], dim=1).to(dtype),
            timestep=timesteps * TIMESTEP_SCALE / TIMESTEP_SCALE, guidance=None,
            encoder_hidden_states=conditioning["encoder_hidden_states"].to(device=noisy.device, dtype=dtype),
            encoder_hidden_states_mask=None if mask is None else mask.to(noisy.device),
            img_shapes=[[(1, f.shape[-2] // 2, f.shape[-1] // 2) for f in frames]] * b, return_dict=False)[0]
        return Pipe._unpack_latents(out[:, : h * w // 4], h, w, 1).squeeze(2).float()

    # ---- LoRA
    def original_names(self, transformer: torch.nn.Module) -> OriginalNames:
        return original_names(tuple(sorted(linear_names(transformer))))

    # ---- rendering
    def render_kwargs(self, settings: QwenPromptSettings, guidance_scale: float, negative_prompt: str) -> dict[str, Any]:
        return {"true_cfg_scale": guidance_scale, "negative_prompt": negative_prompt or " ",
                "max_sequence_length": settings.max_sequence_length}

    # ---- tiny model
    def build_tiny_variant(self, out_dir: Path, variant: FlowVariant) -> Path:
        from .tiny.qwenimage import build_tiny_qwenimage

        return build_tiny_qwenimage(out_dir)


def linear_names(transformer: torch.nn.Module) -> set[str]:
    """The transformer's Linear modules, a LoRA's base layers by their own names."""
    import torch

    return {name.removesuffix(".base_layer") for name, module in transformer.named_modules()
            if isinstance(module, torch.nn.Linear) and ".lora_" not in name}


@cache
def original_names(linear_modules: tuple[str, ...]) -> OriginalNames:
    from diffusers.loaders.single_file_utils import convert_qwen_image21_transformer_checkpoint_to_diffusers

    return derive_original_names(convert_qwen_image21_transformer_checkpoint_to_diffusers,
                                 [f"{name}.weight" for name in linear_modules])


QWEN_IMAGE = QwenImage(
    name="qwen-image", label="Qwen-Image", pipeline_class="QwenImagePipeline",
    components=Components(text=("text_encoder", "tokenizer"), latent=("vae",), denoiser="transformer"),
    kohya=Kohya("qwen_image"), latent_patch=2, text_encoder=QwenPromptEncoder,
    single_file_markers=("transformer_blocks.0.img_mlp.net.0.proj.weight",
                         "model.diffusion_model.transformer_blocks.0.img_mlp.net.0.proj.weight"),
    block_lists=("transformer_blocks",),
)
