"""Z-Image (base and Turbo): a single-stream flow-matching transformer on 16-channel latents,
conditioned on Qwen3 prompt embeddings of variable length.

As ZImagePipeline does it: the caption in Qwen3's chat template (thinking on), tokenized padded to
max_sequence_length (512), Qwen3's penultimate hidden layer (`hidden_states[-2]`) at the caption's
own tokens only: records are stored unpadded (L_i, 2560 at full size), padded per batch with a mask
and handed to the transformer as a list of unpadded tensors, as the pipeline does. Latents are
`(z - shift_factor) * scaling_factor` (Flux.1's VAE), given to the transformer one frame each
(C, 1, H, W); it reads `1 - sigma` as its timestep and predicts `x0 - noise`, so `predict` negates it.

Variants are data: Turbo (step-distilled, 9 steps, no CFG) is told apart by its scheduler's shift
3.0 (the base's is 6.0); LoRAs trained on Turbo break its distillation, so the family names the base
(`Tongyi-MAI/Z-Image`) to train on instead.

Exports: diffusers format, and the ComfyUI file in the names ComfyUI's Z-Image key map reads for
LoRAs: diffusers' module names under `diffusion_model.` (`diffusion_model.layers.N.attention.to_q`),
which it points at their rows of its own fused weights (`attention.qkv`); diffusers' Z-Image
converter reads the same file (ai-toolkit's layout). The modules written are those diffusers'
`convert_z_image_transformer_checkpoint_to_diffusers` makes from the original checkpoint (the
modules ComfyUI's model has); hand-written: the original module names per block
(`ORIGINAL_BLOCK_MODULES`, `ORIGINAL_TOP_MODULES`), the converter's input.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lorapipe.stages.lora_formats.original_names import (OriginalNames, by_diffusers_module, derive_original_names,
                                                         weight_keys)

from .base import Components, Conditioning, Kohya, TextOptions
from .flow import FlowFamily, FlowVariant, presets_field, refuse_negative_prompt
from .qwen_text import QwenPromptEncoder, QwenPromptSettings

if TYPE_CHECKING:
    import torch

BLOCK = r"(layers|noise_refiner|context_refiner)\.\d+\."
ATTENTION = (BLOCK + r"attention\.(to_q|to_k|to_v|to_out\.0)",)
FEED_FORWARD = (BLOCK + r"feed_forward\.(w1|w2|w3)",)
ORIGINAL_BLOCK_MODULES = ("attention.qkv", "attention.out", "feed_forward.w1", "feed_forward.w2",
                          "feed_forward.w3", "adaLN_modulation.0")
ORIGINAL_TOP_MODULES = ("x_embedder", "final_layer.linear", "final_layer.adaLN_modulation.1", "t_embedder.mlp.0",
                        "t_embedder.mlp.2", "cap_embedder.1")
TIMESTEP_SCALE = 1000  # ZImagePipeline's timestep convention: (1000 - t) / 1000 with t = 1000 sigma

VARIANTS = (
    FlowVariant("turbo", "z-image-turbo", 9, 0.0, markers=(("scheduler", "shift", 3.0),), distilled=True,
                train_instead="Tongyi-MAI/Z-Image"),
    FlowVariant("base", "z-image", 50, 4.0),
)


@dataclass(frozen=True)
class ZImage(FlowFamily):
    variants: tuple[FlowVariant, ...] = VARIANTS
    text_arguments: tuple[str, str] = ("cap_feats", "cap_mask")  # ZImagePipeline's names
    lora_presets: dict[str, tuple[str, ...]] = presets_field(ATTENTION, FEED_FORWARD, (BLOCK,))

    # ---- text
    def text_settings(self, model_path: Path, options: TextOptions) -> QwenPromptSettings:
        length = self.text_length(options)
        return QwenPromptSettings(enable_thinking=True, hidden_layers=(-2,), max_sequence_length=length,
                                  token_window=length, pad_to_window=True, keep_padding=False)

    # ---- denoiser
    def predict(self, transformer: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                conditioning: Conditioning, dtype: torch.dtype) -> torch.Tensor:
        """As ZImagePipeline calls its transformer: lists of one-frame latents and unpadded caption
        features, the timestep (1000 - 1000 sigma) / 1000, the output negated."""
        import torch

        embeds, mask = conditioning["cap_feats"], conditioning["cap_mask"]
        t = (TIMESTEP_SCALE - timesteps * TIMESTEP_SCALE) / TIMESTEP_SCALE
        out = transformer(list(noisy.to(dtype).unsqueeze(2).unbind(0)), t.to(dtype),
                          [embeds[i][mask[i]].to(dtype) for i in range(len(embeds))], return_dict=False)[0]
        return -torch.stack([o.float() for o in out]).squeeze(2)

    # ---- LoRA
    def original_names(self, transformer: torch.nn.Module) -> OriginalNames:
        """Each module under its diffusers name (ComfyUI maps those onto its fused weights itself)."""
        return by_diffusers_module(original_names(transformer.config.n_layers, transformer.config.n_refiner_layers))

    # ---- rendering
    def render_kwargs(self, settings: QwenPromptSettings, guidance_scale: float, negative_prompt: str) -> dict[str, Any]:
        if self.bound.distilled:
            refuse_negative_prompt(negative_prompt, f"Z-Image {self.bound.name} renders without guidance and ignores"
                                                    " negative prompts")
        return super().render_kwargs(settings, guidance_scale, negative_prompt)

    # ---- tiny model
    def build_tiny_variant(self, out_dir: Path, variant: FlowVariant) -> Path:
        from .tiny.zimage import build_tiny_zimage

        return build_tiny_zimage(out_dir, variant.distilled)


@cache
def original_names(n_layers: int, n_refiner_layers: int) -> OriginalNames:
    """Z-Image's original module names for a transformer of this shape, from diffusers' converter."""
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers

    blocks = [f"layers.{i}" for i in range(n_layers)]
    blocks += [f"{kind}.{i}" for kind in ("noise_refiner", "context_refiner") for i in range(n_refiner_layers)]
    seeds = weight_keys(blocks, ORIGINAL_BLOCK_MODULES, ORIGINAL_TOP_MODULES)
    return derive_original_names(convert_z_image_transformer_checkpoint_to_diffusers, seeds)


ZIMAGE = ZImage(
    name="z-image", label="Z-Image", pipeline_class="ZImagePipeline",
    components=Components(text=("text_encoder", "tokenizer"), latent=("vae",), denoiser="transformer"),
    kohya=Kohya("z_image"), latent_patch=2, text_encoder=QwenPromptEncoder,
    single_file_markers=("layers.0.attention.qkv.weight", "model.diffusion_model.layers.0.attention.qkv.weight"),
    block_lists=("noise_refiner", "context_refiner", "layers"),
)
