"""Flux.1 (dev and schnell): a flow-matching transformer on 2x2-packed 16-channel latents.

As FluxPipeline does it: the text record is CLIP-L's pooled output plus T5's last hidden state
over `max_sequence_length` tokens, padded and unmasked (Flux.1 saw padded T5 outputs in training,
so records keep the padding); latents are `(z - shift_factor) * scaling_factor`, cached unpacked
(so aspect buckets keep working) and packed 2x2 with their position ids at the denoiser call; the
transformer takes sigma as its timestep and, on dev, a guidance value.

Variants are data (`VARIANTS`), told apart by the transformer's `guidance_embeds`: dev has the
guidance input and reads 512 T5 tokens; schnell has none and reads 256.

Flux.1 Kontext (`FLUX1_KONTEXT`, FluxKontextPipeline) is Flux.1 dev's transformer reading one
reference image for an edit: its packed tokens follow the noisy ones at the denoiser call, with
position ids whose first coordinate is 1; text-to-image (no reference) is Flux.1 dev's call.

LoRA presets: attention; attention + feed-forward (double blocks' attn.to_q/to_k/to_v/to_out.0,
attn.add_q_proj/add_k_proj/add_v_proj/to_add_out, ff.net.*, ff_context.net.*; single blocks'
attn.to_q/to_k/to_v, proj_mlp, proj_out); every Linear of the double and single blocks (kohya's
"all blocks": the embedders and the final layer are left out). Exports: diffusers format under
`transformer.`, and BFL names spelt as kohya (`lora_unet_double_blocks_N_img_attn_qkv`, single
blocks' `linear1` = q|k|v|mlp) and as ComfyUI (`diffusion_model.double_blocks.N.img_attn.qkv`, with
`lora_down`/`lora_up`, the spelling diffusers' Flux.1 loader converts too),
derived from diffusers' `convert_flux_transformer_checkpoint_to_diffusers`
(stages/lora_formats/original_names.py); the seed keys below are the one hand-written part. The
same derivation over every tensor converts a BFL-layout transformer file of any size
(`bfl_transformer`, the family's size-free converter: diffusers' fixes Flux.1's inner width).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from lorapipe.stages.contract import Frozen
from lorapipe.stages.lora_formats.original_names import COMFYUI_DOWN_UP, KOHYA, OriginalNames, TensorMap, \
    apply_tensor_map, derive_tensor_map, names_of

from .base import REFERENCE_LATENTS, Components, Conditioning, ImageGeometry, Kohya, TextOptions, TextRecord, stack
from .flow import FlowFamily, FlowVariant, presets_field, refuse_negative_prompt
from .folders import load_component
from .objectives import ObjectiveParams

if TYPE_CHECKING:
    import torch

MAX_T5_TOKENS = 512  # FluxPipeline refuses more
DOUBLE, SINGLE = r"transformer_blocks\.\d+\.", r"single_transformer_blocks\.\d+\."
ATTENTION = (DOUBLE + r"attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)",
             SINGLE + r"attn\.(to_q|to_k|to_v)")
FEED_FORWARD = (DOUBLE + r"(ff|ff_context)\.net\.(0\.proj|2)", SINGLE + r"(proj_mlp|proj_out)")

VARIANTS = (  # told apart by the transformer's guidance input; schnell reads 256 T5 tokens
    FlowVariant("dev", "flux1", 28, 3.5, markers=(("transformer", "guidance_embeds", True),), guidance_embeds=True),
    FlowVariant("schnell", "flux1-schnell", 4, 0.0, max_sequence_length=256),
)


class Flux1TextSettings(Frozen):
    max_sequence_length: int  # T5 tokens
    padding: Literal["max_length"] = "max_length"  # T5 records padded to max_sequence_length, no mask


class Flux1TextEncoder:
    """FluxPipeline.encode_prompt, batched: CLIP's pooler_output and T5's last hidden state."""

    def __init__(self, model_path: Path, settings: Flux1TextSettings, dtype: torch.dtype, device: str):
        self.settings, self.dtype, self.device = settings, dtype, device
        self.clip_tokenizer, self.t5_tokenizer = (load_component(model_path, n) for n in ("tokenizer", "tokenizer_2"))
        self.clip, self.t5 = (load_component(model_path, n).eval().requires_grad_(False).to(device)
                              for n in ("text_encoder", "text_encoder_2"))

    def too_long(self, caption: str) -> bool:
        return (len(self.t5_tokenizer(caption).input_ids) > self.settings.max_sequence_length
                or len(self.clip_tokenizer(caption).input_ids) > self.clip_tokenizer.model_max_length)

    def __call__(self, captions: list[str]) -> list[TextRecord]:
        import torch

        clip_ids = self.clip_tokenizer(captions, padding="max_length", max_length=self.clip_tokenizer.model_max_length,
                                       truncation=True, return_tensors="pt").input_ids
        t5_ids = self.t5_tokenizer(captions, padding="max_length", max_length=self.settings.max_sequence_length,
                                   truncation=True, return_tensors="pt").input_ids
        with torch.inference_mode():
            pooled = self.clip(clip_ids.to(self.device), output_hidden_states=False).pooler_output
            hidden = self.t5(t5_ids.to(self.device), output_hidden_states=False)[0]
        return [{"hidden_states": hidden[i].to(self.dtype), "pooled": pooled[i].to(self.dtype)}
                for i in range(len(captions))]


@dataclass(frozen=True)
class Flux1(FlowFamily):
    variants: tuple[FlowVariant, ...] = VARIANTS
    lora_presets: dict[str, tuple[str, ...]] = presets_field(ATTENTION, FEED_FORWARD, (DOUBLE, SINGLE))

    # ---- text
    def text_settings(self, model_path: Path, options: TextOptions) -> Flux1TextSettings:
        length = self.text_length(options)
        if length > MAX_T5_TOKENS:
            raise ValueError(f"encode.max_sequence_length: {self.label} reads at most {MAX_T5_TOKENS} T5 tokens,"
                             f" not {length}")
        return Flux1TextSettings(max_sequence_length=length)

    # ---- denoiser
    def conditioning(self, texts: list[TextRecord], images: list[tuple[ImageGeometry, bool]],
                     params: ObjectiveParams) -> Conditioning:
        import torch

        guidance = self.bound.guidance_embeds
        cond = {"encoder_hidden_states": stack(texts, "hidden_states"), "pooled_projections": stack(texts, "pooled")}
        if guidance:
            cond["guidance"] = torch.full((len(texts),), params.guidance, dtype=torch.float32)
        return cond

    def predict(self, transformer: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                conditioning: Conditioning, dtype: torch.dtype) -> torch.Tensor:
        """As FluxPipeline calls its transformer: packed 2x2 latents with (0, row, col) ids, zero text
        ids, sigma as the timestep; the prediction unpacked. With a reference (Kontext's edit pairs),
        as FluxKontextPipeline does: its packed tokens after the noisy ones, with (1, row, col) ids,
        and the prediction of the noisy tokens alone."""
        import torch
        from diffusers import FluxPipeline

        h, w = noisy.shape[-2:]
        tokens, ids = packed(noisy, 0, dtype)
        if REFERENCE_LATENTS in conditioning:
            (reference,) = conditioning[REFERENCE_LATENTS].unbind(1)  # Kontext reads one reference image
            reference_tokens, reference_ids = packed(reference, 1, dtype)
            tokens, ids = torch.cat([tokens, reference_tokens], dim=1), torch.cat([ids, reference_ids])
        text = conditioning["encoder_hidden_states"].to(dtype)
        out = transformer(
            hidden_states=tokens, timestep=timesteps.to(dtype), encoder_hidden_states=text,
            txt_ids=torch.zeros(text.shape[1], 3, device=noisy.device, dtype=dtype), img_ids=ids, return_dict=False,
            **self.text_inputs(conditioning, tokens.shape[1], dtype),
        )[0]
        return FluxPipeline._unpack_latents(out[:, :h * w // 4], h, w, 1).float()

    def text_inputs(self, conditioning: Conditioning, image_tokens: int, dtype: torch.dtype) -> Conditioning:
        """The transformer's inputs besides the tokens, their ids and the text embeddings: CLIP's
        pooled output and, on dev, the guidance value."""
        return {"guidance": conditioning.get("guidance"),
                "pooled_projections": conditioning["pooled_projections"].to(dtype)}

    # ---- LoRA
    def original_names(self, transformer: torch.nn.Module) -> OriginalNames:
        config = transformer.config
        return original_names(config.num_layers, config.num_single_layers, config.guidance_embeds)

    # ---- rendering
    def render_kwargs(self, settings: Flux1TextSettings, guidance_scale: float, negative_prompt: str) -> dict[str, Any]:
        refuse_negative_prompt(negative_prompt, "Flux.1 is guidance-distilled and ignores negative prompts")
        return {"guidance_scale": guidance_scale, "max_sequence_length": settings.max_sequence_length}

    # ---- tiny model
    def build_tiny_variant(self, out_dir: Path, variant: FlowVariant) -> Path:
        from .tiny.flux1 import build_tiny_flux1

        return build_tiny_flux1(out_dir, variant.guidance_embeds, self.pipeline_class)


def packed(latents: torch.Tensor, index: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Latents (B, C, h, w) as the transformer's 2x2 tokens and their (index, row, col) position ids:
    index 0 for the image being denoised, 1 for a reference image (FluxKontextPipeline.prepare_latents)."""
    from diffusers import FluxPipeline

    b, c, h, w = latents.shape
    ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, latents.device, dtype)
    ids[..., 0] = index
    return FluxPipeline._pack_latents(latents, b, c, h, w).to(dtype), ids


@cache
def original_names(num_layers: int, num_single_layers: int, guidance: bool) -> OriginalNames:
    """BFL's module names for a transformer of this shape: its tensor map's weights."""
    return names_of(tensor_map(num_layers, num_single_layers, guidance))


@cache
def tensor_map(num_layers: int, num_single_layers: int, guidance: bool) -> TensorMap:
    """Every diffusers tensor of a transformer of this shape from BFL's, by diffusers' converter."""
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    return derive_tensor_map(convert_flux_transformer_checkpoint_to_diffusers,
                             seed_keys(num_layers, num_single_layers, guidance))


def seed_keys(num_layers: int, num_single_layers: int, guidance: bool) -> list[str]:
    """What diffusers' converter needs to see (hand-written): one key per block, so that it counts
    them, and the guidance embedder's, whose presence it checks."""
    seeds = [f"double_blocks.{i}.img_mod.lin.weight" for i in range(num_layers)]
    seeds += [f"single_blocks.{i}.modulation.lin.weight" for i in range(num_single_layers)]
    return seeds + (["guidance_in.in_layer.weight"] if guidance else [])


def bfl_transformer(tensors: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """A BFL-layout transformer in diffusers' names at any size: diffusers' converter fixes the
    inner width at Flux.1's, its row map (tensor_map) does not."""
    return apply_tensor_map(tensor_map(config["num_layers"], config["num_single_layers"],
                                       config.get("guidance_embeds", False)), tensors)


FLUX1 = Flux1(
    name="flux1", label="Flux.1", pipeline_class="FluxPipeline",
    components=Components(text=("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"), latent=("vae",),
                          denoiser="transformer"),
    kohya=Kohya("flux1"), latent_patch=2, text_encoder=Flux1TextEncoder,
    original_formats=(KOHYA, COMFYUI_DOWN_UP), comfyui_slice_prefix="transformer.",
    single_file_markers=("double_blocks.0.img_attn.qkv.weight",  # BFL's, bare or under ComfyUI's prefix
                         "model.diffusion_model.double_blocks.0.img_attn.qkv.weight"),
    block_lists=("transformer_blocks", "single_transformer_blocks"),
    size_free_converters={"transformer": bfl_transformer},
    checkpoint_prefixes={"vae": "vae.", "text_encoder": "text_encoders.clip_l.transformer.",  # ComfyUI's, whole files
                         "text_encoder_2": "text_encoders.t5xxl.transformer."},
)


@dataclass(frozen=True)
class Flux1Kontext(Flux1):
    """Flux.1 Kontext dev: Flux.1 dev's transformer reading one reference image (predict above); it
    renders edits with FluxKontextPipeline and its demo learns generated edit pairs."""

    def reference_render_kwargs(self, images: list[Any]) -> dict[str, Any]:
        # The pipeline's auto-resize would scale the reference to the nearest of Kontext's preferred sizes;
        # training saw it at the target's size, which _auto_resize=False keeps
        (image,) = images
        return {"image": image, "_auto_resize": False}



KONTEXT_VARIANTS = (FlowVariant("dev", "flux1-kontext", 28, 2.5, guidance_embeds=True),)  # BFL's guidance for it

FLUX1_KONTEXT = Flux1Kontext(
    name="flux1-kontext", label="Flux.1 Kontext", pipeline_class="FluxKontextPipeline",
    components=FLUX1.components, kohya=FLUX1.kohya, latent_patch=2,
    text_encoder=Flux1TextEncoder, render_area_argument="max_area",  # it rescales its output to max_area
    original_formats=FLUX1.original_formats, comfyui_slice_prefix=FLUX1.comfyui_slice_prefix,
    block_lists=FLUX1.block_lists, size_free_converters=FLUX1.size_free_converters,
    checkpoint_prefixes=FLUX1.checkpoint_prefixes,
    variants=KONTEXT_VARIANTS, max_references=1, demo_edits=True,
)
