"""FLUX.3: a flow-matching transformer with per-mode blocks (text, image) then joint single blocks,
on Flux.2's 2x2-patchified, batch-normalised latents, conditioned on stacked Qwen3-VL hidden states.
diffusers ships it only as a modular pipeline (Flux3ModularPipeline, read from its
modular_model_index.json); the family's parts equal its blocks', tested block by block.

Text (flux3_text.py): the caption in the processor's chat template, right-padded to a window of its
own (its token count rounded up to a multiple of 80); hidden layers 4, 8, ..., 32 concatenated per
token, pad rows kept. The transformer takes no text mask, so a batch's records are padded to its
longest only to travel together: predict runs the transformer once per window, each caption in its
own, as the pipeline does (a batch of one window is one call).

Latents: the flux2 family's (the VAE's posterior, patchified, normalised by its batch-norm statistics;
Flux3VaeEncoderStep's). Timesteps: the blocks make their scheduler from a config in their code (no
FLUX.3 folder holds one): a constant shift (Flux3SetTimestepsStep's), so "model" means that static
shift. The denoiser call is Flux3CoreDenoiseStep's: tokens with (t, h, w, l) ids, h and w scaled by
the blocks' image RoPE scale, text ids over every row, sigma as the timestep.

The step-distilled FLUX.3 (Flux3DistilledModularPipeline, a flow-map transformer) is not a variant:
its transformer also reads the timestep each step jumps to, which a training step does not have.

LoRA presets: the text and image mode blocks' and the single blocks' attention (to_q/to_k/to_v/
to_out.0), + their feed-forward (ff.linear_in/linear_out), every Linear of those blocks (the
reference images' mode blocks, unused in text-to-image, are left out). Exports: diffusers format, and
BFL's names (`content_mode_blocks.image.N.q_proj`, `single_blocks.N.mlp_in`, ...) spelt as ComfyUI
(`diffusion_model.*`) and kohya (`lora_unet_*`), derived from diffusers'
`convert_flux3_transformer_checkpoint_to_diffusers`. Rendering: the modular pipeline (modular.py)
without its prompt upsampler.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from lorapipe.stages.lora_formats.original_names import (COMFYUI, KOHYA, OriginalNames, derive_original_names,
                                                         weight_keys)

from .base import Components, Conditioning, ImageGeometry, Kohya, TextOptions, TextRecord, pad_sequences
from .flow import FlowFamily, FlowVariant, presets_field
from .flux3_text import Flux3PromptEncoder
from .latents import PatchedBatchNorm, patched_batch_norm_of
from .objectives import ObjectiveParams
from .qwen_text import QwenPromptSettings

if TYPE_CHECKING:
    import torch

MODE, SINGLE = r"(txt_mode_blocks|mode_blocks\.image)\.\d+\.", r"single_transformer_blocks\.\d+\."
ATTENTION = (MODE + r"attn\.(to_q|to_k|to_v|to_out\.0)", SINGLE + r"attn\.(to_q|to_k|to_v|to_out\.0)")
FEED_FORWARD = (MODE + r"ff\.(linear_in|linear_out)", SINGLE + r"ff\.(linear_in|linear_out)")
HIDDEN_LAYERS = (4, 8, 12, 16, 20, 24, 28, 32)  # Flux3TextEncoderStep's text_encoder_out_layers
MAX_TOKENS = 8192  # Flux3TextEncoderStep's max_sequence_length
SHIFT = 6.93  # Flux3SetTimestepsStep's constant shift, on the scheduler it makes from its config
TIMESTEP_SCALE = 1000  # the scheduler's timesteps are 1000 sigma; the loop denoiser gives the transformer t / 1000
TEXT_WINDOW = "text_window"  # the conditioning's tokens of each caption's own window
MODES = ("image", "image_cond")  # the transformer's content modes (mode_blocks, x_embedders)
ORIGINAL_BLOCK = ("q_proj", "k_proj", "v_proj", "attn_out", "mlp_in", "mlp_out")
ORIGINAL_TOP = ("time_in.in_layer", "time_in.out_layer", "txt_in", "final_layer.image.linear",
                "final_layer.image.adaLN_modulation.1",
                *(f"{stream}.{mode}.lin" for stream in ("early_stream_modulations", "single_stream_modulations")
                  for mode in (*MODES, "txt")),
                *(f"emb_in.{mode}" for mode in MODES))

VARIANTS = (FlowVariant("base", "flux3", 50, 3.5, max_sequence_length=MAX_TOKENS),)  # the blocks' steps and guider


@dataclass(frozen=True)
class Flux3(FlowFamily):
    variants: tuple[FlowVariant, ...] = VARIANTS
    normalisation_of: Callable[[Path, str], PatchedBatchNorm] = patched_batch_norm_of
    lora_presets: dict[str, tuple[str, ...]] = presets_field(ATTENTION, FEED_FORWARD, (MODE, SINGLE))

    # ---- text
    def text_settings(self, model_path: Path, options: TextOptions) -> QwenPromptSettings:
        length = self.text_length(options)
        return QwenPromptSettings(hidden_layers=HIDDEN_LAYERS, max_sequence_length=length, token_window=length,
                                  pad_to_window=False, keep_padding=True)

    # ---- denoiser
    def conditioning(self, texts: list[TextRecord], images: list[tuple[ImageGeometry, bool]],
                     params: ObjectiveParams) -> Conditioning:
        """The records padded to the batch's longest, to travel together, and each one's window."""
        embeds, mask = pad_sequences(texts, "hidden_states")
        return {"encoder_hidden_states": embeds, TEXT_WINDOW: mask.sum(dim=1)}

    def predict(self, transformer: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                conditioning: Conditioning, dtype: torch.dtype) -> torch.Tensor:
        """One transformer call per text window in the batch, each on its rows and its window's text rows
        (the transformer attends to every text row it is given)."""
        import torch

        windows, text = conditioning[TEXT_WINDOW].to(noisy.device), conditioning["encoder_hidden_states"]
        sigmas = timesteps * TIMESTEP_SCALE / TIMESTEP_SCALE
        out = torch.empty(noisy.shape, dtype=torch.float32, device=noisy.device)
        for window in windows.unique().tolist():
            rows = (windows == window).nonzero().flatten()
            out[rows] = predict_window(transformer, noisy[rows], sigmas[rows], text[rows.to(text.device), :window], dtype)
        return out

    # ---- LoRA
    def original_names(self, transformer: torch.nn.Module) -> OriginalNames:
        return original_names(transformer.config.num_layers, transformer.config.num_single_layers)

    # ---- rendering
    def render_kwargs(self, settings: QwenPromptSettings, guidance_scale: float, negative_prompt: str) -> dict[str, Any]:
        return {**super().render_kwargs(settings, guidance_scale, negative_prompt),
                "text_encoder_out_layers": settings.hidden_layers}

    # ---- tiny model
    def build_tiny_variant(self, out_dir: Path, variant: FlowVariant) -> Path:
        from .tiny.flux3 import build_tiny_flux3

        return build_tiny_flux3(out_dir)


def predict_window(transformer: torch.nn.Module, noisy: torch.Tensor, sigmas: torch.Tensor, text: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """The transformer's prediction for (B, C, h, w) noisy latents at `sigmas` (B,) given (B, L, D) text
    records of one window, in the latents' layout, as Flux3CoreDenoiseStep calls it: the latents
    flattened to tokens, image ids (t, h, w, l) with h and w scaled by the blocks' image RoPE scale, text
    ids (0, 0, 0, position) over every row of the records, sigma as the timestep."""
    from diffusers.modular_pipelines.flux3.before_denoise import (Flux3PrepareLatentsStep, Flux3TextRoPEInputsStep,
                                                                  _prepare_image_ids)

    tokens = noisy.flatten(2).transpose(1, 2)
    image_ids = _prepare_image_ids(noisy.shape[2], noisy.shape[3], Flux3PrepareLatentsStep().image_rope_scale)
    out = transformer(hidden_states=tokens.to(dtype), encoder_hidden_states=text.to(noisy.device, dtype),
                      timestep=sigmas.to(dtype), img_ids=image_ids.to(noisy.device),
                      txt_ids=Flux3TextRoPEInputsStep._prepare_text_ids(text).to(noisy.device), return_dict=False)[0]
    return out.transpose(1, 2).reshape(noisy.shape).float()


@cache
def original_names(num_layers: int, num_single_layers: int) -> OriginalNames:
    """BFL's FLUX.3 module names for a transformer of this shape, from diffusers' converter."""
    from diffusers.loaders.single_file_utils import convert_flux3_transformer_checkpoint_to_diffusers

    blocks = [f"content_mode_blocks.{mode}.{i}" for mode in MODES for i in range(num_layers)]
    blocks += [f"txt_mode_blocks.{i}" for i in range(num_layers)]
    blocks += [f"single_blocks.{i}" for i in range(num_single_layers)]
    return derive_original_names(convert_flux3_transformer_checkpoint_to_diffusers,
                                 weight_keys(blocks, ORIGINAL_BLOCK, ORIGINAL_TOP))


FLUX3 = Flux3(
    name="flux3", label="FLUX.3", pipeline_class="Flux3ModularPipeline",
    components=Components(text=("text_encoder", "tokenizer"), latent=("vae",), denoiser="transformer",
                          scheduler=None),
    kohya=Kohya("flux3"), latent_patch=2, text_encoder=Flux3PromptEncoder, sequence_patch=1,
    original_formats=(KOHYA, COMFYUI), code_scheduler_config=(("shift", SHIFT),),
    single_file_markers=("early_stream_modulations.image.lin.weight",  # BFL's names, bare or under ComfyUI's prefix
                         "model.diffusion_model.early_stream_modulations.image.lin.weight"),
    block_lists=("txt_mode_blocks", "mode_blocks.image", "single_transformer_blocks"), render_left_out=("prompt_upsampler",),
)
