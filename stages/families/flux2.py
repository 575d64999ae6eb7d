"""Flux.2-klein (4B and 9B; base and step-distilled): a flow-matching transformer on 2x2-patchified,
batch-normalised 32-channel latents, conditioned on stacked Qwen3 hidden states.

As Flux2KleinPipeline does it: the caption in Qwen3's chat template with thinking off, tokenized
padded to max_sequence_length (512), hidden layers 9, 18 and 27 concatenated per token; every
position is kept (the transformer reads the padding's states, unmasked), so a record is (512, 3 x
2560) at 4B. The layer list is a text setting, in the record's key. Latents are patchified 2x2 and
normalised with the VAE's batch-norm running statistics (latents.PatchedBatchNorm): the objective and
the transformer work in that (128, H/16, W/16) layout, packed to tokens with (t, h, w, l) ids; the
transformer reads sigma (the pipeline's t / 1000) and has no guidance input on Klein.

Timesteps: the pipeline shifts its sigmas by Flux.2's empirical mu of the image's token count and
the step count when the scheduler config asks for dynamic shifting, so "model" means that shift at
the variant's render steps (objectives.TimestepSampling.shift_steps overrides them).

Edit pairs: Klein takes up to four reference images (BFL's API bound; diffusers' pipeline sets none).
The pipeline encodes each as the target is encoded (posterior mode, patchified, the same batch-norm
normalisation), so a reference's record is normalised like a target's; its tokens follow the noisy
ones with ids (10 + 10 k, row, col, 0) for the k-th reference, and only the noisy tokens' prediction
is kept. The pipeline keeps a reference image of at most 1024 x 1024 pixels as it is and shrinks a
larger one to that area.

Variants are data: the distilled Klein (4 steps) is told apart by model_index.json's `is_distilled`;
training on it breaks the distillation, so the family names the base checkpoints instead.

LoRA presets: attention (double blocks' attn.to_q/to_k/to_v/to_out.0/add_*_proj/to_add_out; single
blocks' fused attn.to_qkv_mlp_proj and attn.to_out, whose omission is known to hurt); + feed-forward
(ff/ff_context.linear_in/linear_out); every Linear of the blocks. Exports: diffusers format, and
BFL's names (`double_blocks.N.img_attn.qkv` q|k|v fused, `single_blocks.N.linear1/linear2`) spelt as
ComfyUI/ai-toolkit (`diffusion_model.*`) and as kohya/musubi-tuner (`lora_unet_*`), derived from
diffusers' `convert_flux2_transformer_checkpoint_to_diffusers`. Hand-written: the original module
names (`ORIGINAL_*`), the converter's input.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from lorapipe.stages.lora_formats.original_names import (COMFYUI, KOHYA, OriginalNames, derive_original_names,
                                                         weight_keys)

from .base import (MODEL_INDEX, REFERENCE_LATENTS, Components, Conditioning, ImageGeometry, Kohya, TextOptions,
                   TextRecord, stack)
from .flow import FlowFamily, FlowVariant, presets_field, refuse_negative_prompt
from .latents import PatchedBatchNorm, patched_batch_norm_of
from .objectives import ObjectiveParams, TimestepSampling
from .qwen_text import QwenPromptEncoder, QwenPromptSettings

if TYPE_CHECKING:
    import torch

DOUBLE, SINGLE = r"transformer_blocks\.\d+\.", r"single_transformer_blocks\.\d+\."
ATTENTION = (DOUBLE + r"attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)",
             SINGLE + r"attn\.(to_qkv_mlp_proj|to_out)")
FEED_FORWARD = (DOUBLE + r"(ff|ff_context)\.(linear_in|linear_out)",)
HIDDEN_LAYERS = (9, 18, 27)  # Flux2KleinPipeline's text_encoder_out_layers
ORIGINAL_DOUBLE = ("img_attn.qkv", "img_attn.proj", "img_mlp.0", "img_mlp.2",
                   "txt_attn.qkv", "txt_attn.proj", "txt_mlp.0", "txt_mlp.2")
ORIGINAL_SINGLE = ("linear1", "linear2")
ORIGINAL_TOP = ("img_in", "txt_in", "time_in.in_layer", "time_in.out_layer", "double_stream_modulation_img.lin",
                "double_stream_modulation_txt.lin", "single_stream_modulation.lin", "final_layer.linear",
                "final_layer.adaLN_modulation.1")
TIMESTEP_SCALE = 1000  # the pipeline's scheduler timesteps are 1000 sigma; the transformer reads t / 1000
MAX_REFERENCES = 4  # what BFL's API takes for Klein; the diffusers pipeline sets no bound
REFERENCE_MAX_AREA = 1024 * 1024  # the Flux.2 pipelines shrink a larger reference image to this area
BASES = "black-forest-labs/FLUX.2-klein-base-4B (or -base-9B for the 9B model)"

VARIANTS = (
    FlowVariant("distilled", "flux2-klein-distilled", 4, 1.0, markers=((MODEL_INDEX, "is_distilled", True),),
                distilled=True, train_instead=BASES),
    FlowVariant("base", "flux2-klein", 50, 4.0),
)


@dataclass(frozen=True)
class Flux2Klein(FlowFamily):
    variants: tuple[FlowVariant, ...] = VARIANTS
    normalisation_of: Callable[[Path, str], PatchedBatchNorm] = patched_batch_norm_of
    lora_presets: dict[str, tuple[str, ...]] = presets_field(ATTENTION, FEED_FORWARD, (DOUBLE, SINGLE))

    # ---- text
    def text_settings(self, model_path: Path, options: TextOptions) -> QwenPromptSettings:
        length = self.text_length(options)
        return QwenPromptSettings(enable_thinking=False, hidden_layers=HIDDEN_LAYERS, max_sequence_length=length,
                                  token_window=length, pad_to_window=True, keep_padding=True)

    # ---- latents and objective
    def model_shift(self, scheduler_config: dict) -> TimestepSampling | None:
        if not scheduler_config.get("use_dynamic_shifting"):
            return None  # the pipeline's mu is ignored: the config's static shift
        return TimestepSampling(shift="empirical", shift_steps=self.bound.render_steps)

    # ---- denoiser
    def conditioning(self, texts: list[TextRecord], images: list[tuple[ImageGeometry, bool]],
                     params: ObjectiveParams) -> Conditioning:
        import torch

        cond = {"encoder_hidden_states": stack(texts, "hidden_states")}
        if self.bound.guidance_embeds:  # Flux.2-dev's guidance input; none on Klein
            cond["guidance"] = torch.full((len(texts),), params.guidance, dtype=torch.float32)
        return cond

    def predict(self, transformer: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                conditioning: Conditioning, dtype: torch.dtype) -> torch.Tensor:
        """As Flux2KleinPipeline calls its transformer: the patchified latents packed to tokens with
        (0, row, col, 0) ids, an edit pair's references after them (with_references), text ids (0, 0,
        0, position), t / 1000, the guidance where the model has its input (as Flux2Pipeline passes
        it; none on Klein); the noisy tokens' prediction unpacked back."""
        from diffusers import Flux2KleinPipeline as Pipe

        text = conditioning["encoder_hidden_states"].to(device=noisy.device, dtype=dtype)
        latent_ids = Pipe._prepare_latent_ids(noisy).to(noisy.device)
        tokens, ids = with_references(Pipe._pack_latents(noisy), latent_ids, conditioning.get(REFERENCE_LATENTS))
        t = timesteps * TIMESTEP_SCALE / TIMESTEP_SCALE
        guidance = conditioning.get("guidance")
        out = transformer(hidden_states=tokens.to(dtype), timestep=t.to(dtype),
                          guidance=None if guidance is None else guidance.to(noisy.device),
                          encoder_hidden_states=text, txt_ids=Pipe._prepare_text_ids(text).to(noisy.device),
                          img_ids=ids, return_dict=False)[0]
        noisy_tokens = out[:, :latent_ids.shape[1]]
        return Pipe._unpack_latents_with_ids(noisy_tokens, latent_ids, noisy.shape[2], noisy.shape[3]).float()

    # ---- LoRA
    def original_names(self, transformer: torch.nn.Module) -> OriginalNames:
        config = transformer.config
        return original_names(config.num_layers, config.num_single_layers, config.guidance_embeds)

    # ---- rendering
    def render_kwargs(self, settings: QwenPromptSettings, guidance_scale: float, negative_prompt: str) -> dict[str, Any]:
        refuse_negative_prompt(negative_prompt, "Flux2KleinPipeline guides with an empty prompt and takes no"
                                                " negative prompt")
        return {"guidance_scale": guidance_scale, "max_sequence_length": settings.max_sequence_length,
                "text_encoder_out_layers": settings.hidden_layers}

    def reference_render_kwargs(self, images: list[Any]) -> dict[str, Any]:
        """The references as the list the Flux.2 pipelines take. It keeps an image of at most 1024 x 1024
        pixels with sides multiples of 16 as it is (images placed at a target's size are), and shrinks
        a larger one to that area: refused, as it would not be the reference training saw."""
        for image in images:
            if image.width * image.height > REFERENCE_MAX_AREA:
                raise ValueError(f"evaluate.resolution: {self.pipeline_class} shrinks a reference image above"
                                 f" 1024 x 1024 pixels ({image.width} x {image.height}) to that area, so it would"
                                 f" not be the reference training saw; render at 1024 or less")
        return {"image": list(images)}

    # ---- tiny model
    def build_tiny_variant(self, out_dir: Path, variant: FlowVariant) -> Path:
        from .tiny.flux2 import build_tiny_flux2

        return build_tiny_flux2(out_dir, variant.distilled)


def with_references(tokens: torch.Tensor, ids: torch.Tensor,
                    references: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The noisy tokens and ids followed, for an edit pair, by its references' (B, K, C, h, w) tokens and
    ids, as Flux2KleinPipeline.prepare_image_latents makes them: each reference packed like the
    latents, in order, with a time offset of its own (_prepare_image_ids)."""
    if references is None:
        return tokens, ids
    import torch
    from diffusers import Flux2KleinPipeline as Pipe

    references = references.to(tokens.device)
    each = [references[:, k] for k in range(references.shape[1])]
    reference_ids = Pipe._prepare_image_ids([r[:1] for r in each]).to(ids.device).expand(len(tokens), -1, -1)
    reference_tokens = torch.cat([Pipe._pack_latents(r) for r in each], dim=1).to(tokens.dtype)
    return torch.cat([tokens, reference_tokens], dim=1), torch.cat([ids, reference_ids], dim=1)


@cache
def original_names(num_layers: int, num_single_layers: int, guidance: bool) -> OriginalNames:
    """BFL's Flux.2 module names for a transformer of this shape, from diffusers' converter."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    return derive_original_names(convert_flux2_transformer_checkpoint_to_diffusers,
                                 seed_keys(num_layers, num_single_layers, guidance))


def seed_keys(num_layers: int, num_single_layers: int, guidance: bool) -> list[str]:
    """BFL's Flux.2 weight names for a transformer of this shape (diffusers' converter renames the
    keys it is given, so it is given every weight)."""
    seeds = weight_keys((f"double_blocks.{i}" for i in range(num_layers)), ORIGINAL_DOUBLE)
    seeds += weight_keys((f"single_blocks.{i}" for i in range(num_single_layers)), ORIGINAL_SINGLE, ORIGINAL_TOP)
    return seeds + (["guidance_in.in_layer.weight", "guidance_in.out_layer.weight"] if guidance else [])


FLUX2_KLEIN = Flux2Klein(
    name="flux2-klein", label="Flux.2-klein", pipeline_class="Flux2KleinPipeline",
    components=Components(text=("text_encoder", "tokenizer"), latent=("vae",), denoiser="transformer"),
    kohya=Kohya("flux2_klein"), latent_patch=2, text_encoder=QwenPromptEncoder,
    sequence_patch=1, original_formats=(KOHYA, COMFYUI),
    single_file_markers=("double_stream_modulation_img.lin.weight",  # shared modulation: Flux.2's, not Flux.1's
                         "model.diffusion_model.double_stream_modulation_img.lin.weight"),
    block_lists=("transformer_blocks", "single_transformer_blocks"), max_references=MAX_REFERENCES,
)
