"""Chroma (Chroma1-HD, Chroma1-Base): Flux.1's transformer without CLIP, its modulation made by a
distilled-guidance approximator from the timestep alone, on Flux.1's VAE and 2x2 packing.

As ChromaPipeline does it: T5 alone, its captions padded to `max_sequence_length` and encoded with
the tokenizer's mask (Flux.1 encodes unmasked); the record keeps every position, padding included,
and the mask the transformer reads: the caption's tokens and the first padding token. The pipeline
hands that mask to the transformer as 0/1 floats, which diffusers' attention adds to the scores:
the other padding tokens are read, weighted e^-1 against the rest, so records keep them. The
transformer takes sigma as its timestep, no guidance and no pooled text (with gradient checkpointing,
the family hands its single blocks the mask diffusers leaves out: keep_mask_when_checkpointed); the
pipeline renders with real classifier-free guidance and a negative prompt. Packing, latent normalisation, presets and the
export spellings are Flux.1's (a `Flux1` subclass). Chroma1-HD and Chroma1-Base share their configs:
one variant.

Exports: diffusers format under `transformer.`; Chroma's original names (Flux.1's blocks, fused as
BFL fuses them, and `distilled_guidance_layer.*`), derived from diffusers'
`convert_chroma_transformer_checkpoint_to_diffusers`, spelt as kohya and as ComfyUI, whose Chroma
model is a Flux model and also maps Flux.1's diffusers names under `transformer.`. The same row map
converts a transformer file in the original layout at any size (diffusers' converter fixes Flux.1's
inner width).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from lorapipe.stages.contract import Frozen
from lorapipe.stages.lora_formats.original_names import OriginalNames, TensorMap, apply_tensor_map, \
    derive_tensor_map, names_of

from .base import Components, Conditioning, ImageGeometry, Kohya, TextOptions, TextRecord, stack
from .flow import FlowFamily, FlowVariant
from .flux1 import FLUX1, Flux1
from .folders import load_component
from .objectives import ObjectiveParams

if TYPE_CHECKING:
    import torch

VARIANTS = (FlowVariant("chroma1", "chroma", 35, 5.0),)  # ChromaPipeline's default steps and guidance


class ChromaTextSettings(Frozen):
    max_sequence_length: int  # T5 tokens
    padding: Literal["max_length"] = "max_length"  # records hold every position, encoded with the tokenizer's mask
    mask: Literal["tokens_and_first_pad"] = "tokens_and_first_pad"  # what the record's mask marks (the rest: e^-1)


class ChromaTextEncoder:
    """ChromaPipeline._get_t5_prompt_embeds, batched: T5's last hidden state at every position, and
    the mask the transformer reads."""

    def __init__(self, model_path: Path, settings: ChromaTextSettings, dtype: torch.dtype, device: str):
        self.settings, self.dtype, self.device = settings, dtype, device
        self.tokenizer = load_component(model_path, "tokenizer")
        self.t5 = load_component(model_path, "text_encoder").eval().requires_grad_(False).to(device)

    def too_long(self, caption: str) -> bool:
        return len(self.tokenizer(caption).input_ids) > self.settings.max_sequence_length

    def __call__(self, captions: list[str]) -> list[TextRecord]:
        import torch

        tokens = self.tokenizer(captions, padding="max_length", max_length=self.settings.max_sequence_length,
                                truncation=True, return_tensors="pt")
        with torch.inference_mode():
            hidden = self.t5(tokens.input_ids.to(self.device), attention_mask=tokens.attention_mask.to(self.device),
                             output_hidden_states=False)[0]
        positions = torch.arange(tokens.attention_mask.shape[1])
        read = positions[None] <= tokens.attention_mask.sum(1, keepdim=True)  # the tokens and the first padding one
        return [{"hidden_states": hidden[i].to(self.dtype), "attention_mask": read[i].to(self.dtype)}
                for i in range(len(captions))]


@dataclass(frozen=True)
class Chroma(Flux1):
    variants: tuple[FlowVariant, ...] = VARIANTS  # Flux.1's presets: the same blocks

    # ---- text
    def text_settings(self, model_path: Path, options: TextOptions) -> ChromaTextSettings:
        return ChromaTextSettings(max_sequence_length=super().text_settings(model_path, options).max_sequence_length)

    # ---- denoiser
    def conditioning(self, texts: list[TextRecord], images: list[tuple[ImageGeometry, bool]],
                     params: ObjectiveParams) -> Conditioning:
        return {"encoder_hidden_states": stack(texts, "hidden_states"), "attention_mask": stack(texts, "attention_mask")}

    def load_denoiser(self, model_path: Path, dtype: torch.dtype) -> torch.nn.Module:
        transformer = super().load_denoiser(model_path, dtype)
        keep_mask_when_checkpointed(transformer)
        return transformer

    def text_inputs(self, conditioning: Conditioning, image_tokens: int, dtype: torch.dtype) -> Conditioning:
        """The text mask followed by the image tokens', all read (ChromaPipeline._prepare_attention_mask)."""
        import torch

        mask = conditioning["attention_mask"]
        image = torch.ones(mask.shape[0], image_tokens, device=mask.device, dtype=mask.dtype)
        return {"attention_mask": torch.cat([mask, image], dim=1).to(dtype)}

    # ---- LoRA
    def original_names(self, transformer: torch.nn.Module) -> OriginalNames:
        config = transformer.config
        return original_names(config.num_layers, config.num_single_layers, config.approximator_layers)

    # ---- rendering
    render_kwargs = FlowFamily.render_kwargs  # real classifier-free guidance, not Flux.1's distilled guidance

    # ---- tiny model
    def build_tiny_variant(self, out_dir: Path, variant: FlowVariant) -> Path:
        from .tiny.chroma import build_tiny_chroma

        return build_tiny_chroma(out_dir)


def keep_mask_when_checkpointed(transformer: torch.nn.Module) -> None:
    """Hand each single block the attention mask of the transformer call it runs in when the call left it
    out: with gradient checkpointing on, diffusers 0.42.1's ChromaTransformer2DModel calls its single
    blocks without it (its double blocks, and every block without checkpointing, get it), which would
    train another function than the pipeline renders. The mask is the latest call's when a checkpointed
    block is recomputed: the step's backward follows its own forward."""
    call: dict[str, torch.Tensor | None] = {}

    def remember(module, args, kwargs):
        call["attention_mask"] = kwargs.get("attention_mask")

    def hand_over(block, args, kwargs):
        if len(args) < 4 and "attention_mask" not in kwargs:  # (hidden_states, temb, image_rotary_emb) alone
            return args, {**kwargs, "attention_mask": call["attention_mask"]}
        return None

    transformer.register_forward_pre_hook(remember, with_kwargs=True)
    for block in transformer.single_transformer_blocks:
        block.register_forward_pre_hook(hand_over, with_kwargs=True)


@cache
def original_names(num_layers: int, num_single_layers: int, approximator_layers: int) -> OriginalNames:
    """Chroma's module names for a transformer of this shape: its tensor map's weights."""
    return names_of(tensor_map(num_layers, num_single_layers, approximator_layers))


@cache
def tensor_map(num_layers: int, num_single_layers: int, approximator_layers: int) -> TensorMap:
    """Every diffusers tensor of a transformer of this shape from Chroma's, by diffusers' converter,
    seeded with one key per block so that it counts them (hand-written)."""
    from diffusers.loaders.single_file_utils import convert_chroma_transformer_checkpoint_to_diffusers

    seeds = [f"double_blocks.{i}.img_attn.qkv.weight" for i in range(num_layers)]
    seeds += [f"single_blocks.{i}.linear1.weight" for i in range(num_single_layers)]
    seeds += [f"distilled_guidance_layer.layers.{i}.in_layer.weight" for i in range(approximator_layers)]
    return derive_tensor_map(convert_chroma_transformer_checkpoint_to_diffusers, seeds)


def chroma_transformer(tensors: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """A Chroma-layout transformer in diffusers' names at any size (the family's size-free converter)."""
    return apply_tensor_map(tensor_map(config["num_layers"], config["num_single_layers"],
                                       config["approximator_layers"]), tensors)


CHROMA = Chroma(
    name="chroma", label="Chroma", pipeline_class="ChromaPipeline",
    components=Components(text=("text_encoder", "tokenizer"), latent=("vae",), denoiser="transformer"),
    kohya=Kohya("chroma"), latent_patch=2, text_encoder=ChromaTextEncoder,
    original_formats=FLUX1.original_formats, comfyui_slice_prefix=FLUX1.comfyui_slice_prefix,
    single_file_markers=("distilled_guidance_layer.in_proj.bias",  # bare or under ComfyUI's prefix
                         "model.diffusion_model.distilled_guidance_layer.in_proj.bias"),
    block_lists=FLUX1.block_lists, size_free_converters={"transformer": chroma_transformer},
)
