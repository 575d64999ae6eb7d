"""Kandinsky 5 (text-to-image): a flow-matching transformer of text blocks and visual blocks on the
Flux.1 VAE's 16-channel latents, conditioned on Qwen2.5-VL hidden states and a CLIP pooled vector.

Text, as Kandinsky5T2IPipeline.encode_prompt does it (its own `_encode_prompt_qwen` and
`_encode_prompt_clip` run): the caption cleaned by its `prompt_clean` (ftfy, as Wan's), in the
pipeline's system template, Qwen2.5-VL's last hidden state with the template's first 40 tokens cut
off (at most max_sequence_length kept), and CLIP's pooled output of the caption (77 tokens). A record
holds the caption's own tokens (`hidden_states` (L, 3584)) and `pooled` (768,). The transformer takes
no text mask (the pipeline encodes a prompt alone, at its own length): a batch's rows whose texts
differ in length run through it apart, each as the pipeline runs one prompt.

Latents: records (16, H/8, W/8) of the Flux.1 VAE, normalised by its scaling_factor alone (the
pipelines multiply by it and ignore the config's shift_factor); the transformer reads them
channels-last as one frame (B, 1, H, W, C), the scheduler's timestep (1000 sigma), 3-D rope
positions in 2x2 patches and the text's positions 0..L-1.

Exports: diffusers format, and ComfyUI's (comfy/ldm/kandinsky5) names under `diffusion_model.`:
the original checkpoint's, which are diffusers' module names (diffusers has no converter for it).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable

from pydantic import Field

from lorapipe.stages.contract import Frozen
from lorapipe.stages.lora_formats.original_names import OriginalNames, whole

from .base import REFERENCE_LATENTS, Components, Conditioning, ImageGeometry, Kohya, TextOptions, TextRecord, stack
from .flow import FlowFamily, FlowVariant, presets_field
from .folders import component_config, load_component
from .latents import ScaleShift
from .objectives import FlowMatchingObjective, ObjectiveParams
from .qwenimage import linear_names
from .wan import check_ftfy, ftfy_version

if TYPE_CHECKING:
    import torch

IMAGE_TEMPLATE = ("<|im_start|>system\nYou are a prompt engineer. Describe the image by detailing the color, shape,"
                  " size, texture, quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
                  "<|im_start|>user\n{}<|im_end|>")  # Kandinsky5T2IPipeline.prompt_template
IMAGE_TEMPLATE_TOKENS = 40  # Kandinsky5T2IPipeline.prompt_template_encode_start_idx
BLOCK = r"(text_transformer_blocks|visual_transformer_blocks)\.\d+\."
ATTENTION = (BLOCK + r"(self_attention|cross_attention)\.(to_query|to_key|to_value|out_layer)",)
FEED_FORWARD = (BLOCK + r"feed_forward\.(in_layer|out_layer)",)
TIMESTEP_SCALE = 1000  # the pipeline's timesteps are the scheduler's, 1000 sigma
POOLED = "pooled_projections"

VARIANTS = (FlowVariant("5.0-t2i-lite", "kandinsky5", 50, 3.5),)


class Kandinsky5TextSettings(Frozen):
    template: str = Field(description="the pipeline's prompt template, '{}' the cleaned caption")
    template_tokens: int = Field(ge=0, description="the template's tokens cut off the hidden states")
    max_sequence_length: int = Field(gt=0, description="Qwen2.5-VL tokens a record holds at most")
    ftfy: str | None = Field(description="the ftfy version the pipeline's prompt_clean fixes captions with"
                             " (None: ftfy is not installed and captions are not fixed)")


class Kandinsky5TextEncoder:
    """Kandinsky5T2IPipeline.encode_prompt, batched: each caption's Qwen2.5-VL states at its own
    tokens and its CLIP pooled vector, by the pipeline's own encoding methods."""

    def __init__(self, model_path: Path, settings: Kandinsky5TextSettings, dtype: torch.dtype, device: str):
        check_ftfy(settings.ftfy)
        self.settings, self.dtype, self.device = settings, dtype, device
        self.encoders = SimpleNamespace(  # what the pipeline's encoding methods read of the pipeline
            prompt_template=settings.template, prompt_template_encode_start_idx=settings.template_tokens,
            tokenizer=load_component(model_path, "tokenizer"), tokenizer_2=load_component(model_path, "tokenizer_2"),
            text_encoder=load_component(model_path, "text_encoder").eval().requires_grad_(False).to(device),
            text_encoder_2=load_component(model_path, "text_encoder_2").eval().requires_grad_(False).to(device))

    def too_long(self, caption: str) -> bool:
        from diffusers.pipelines.kandinsky5.pipeline_kandinsky_t2i import prompt_clean

        s = self.settings
        tokens = self.encoders.tokenizer(text=[s.template.format(prompt_clean(caption))]).input_ids[0]
        return len(tokens) > s.template_tokens + s.max_sequence_length

    def __call__(self, captions: list[str]) -> list[TextRecord]:
        import torch
        from diffusers import Kandinsky5T2IPipeline as Pipeline
        from diffusers.pipelines.kandinsky5.pipeline_kandinsky_t2i import prompt_clean

        cleaned = [prompt_clean(c) for c in captions]
        with torch.inference_mode():
            hidden, bounds = Pipeline._encode_prompt_qwen(self.encoders, cleaned, self.device,
                                                          self.settings.max_sequence_length, self.dtype)
            pooled = Pipeline._encode_prompt_clip(self.encoders, cleaned, self.device, self.dtype)
        lengths = bounds.diff().tolist()  # the tokenizer pads on the right: each caption's states come first
        return [{"hidden_states": hidden[i, :n].cpu(), "pooled": pooled[i].cpu()} for i, n in enumerate(lengths)]


def scaling_factor_of(model_path: Path, vae: str) -> ScaleShift:
    """`z * scaling_factor`: the Kandinsky 5 pipelines leave the VAE config's shift_factor out."""
    return ScaleShift(scale=component_config(model_path, vae)["scaling_factor"])


def unscaled_rope(latent_height: int, latent_width: int) -> tuple[float, float, float]:
    """Kandinsky5T2IPipeline's rope scale: none, at every size."""
    return (1.0, 1.0, 1.0)


class EveryResolution(list):
    """Kandinsky5T2IPipeline renders a size not in its `resolutions` at the nearest of its own
    (1024-pixel) ones: with this, at evaluate.resolution, as every family renders."""

    def __contains__(self, size: object) -> bool:
        return True


@dataclass(frozen=True)
class Kandinsky5(FlowFamily):
    variants: tuple[FlowVariant, ...] = VARIANTS
    normalisation_of: Callable[[Path, str], ScaleShift] = scaling_factor_of
    lora_presets: dict[str, tuple[str, ...]] = presets_field(ATTENTION, FEED_FORWARD, (BLOCK,))
    template: str = IMAGE_TEMPLATE
    template_tokens: int = IMAGE_TEMPLATE_TOKENS
    rope_scale: Callable[[int, int], tuple[float, float, float]] = unscaled_rope  # (latent height, width) -> (t, h, w)

    # ---- text
    def text_settings(self, model_path: Path, options: TextOptions) -> Kandinsky5TextSettings:
        return Kandinsky5TextSettings(template=self.template, template_tokens=self.template_tokens,
                                      max_sequence_length=self.text_length(options),
                                      ftfy=ftfy_version())

    # ---- denoiser
    def conditioning(self, texts: list[TextRecord], images: list[tuple[ImageGeometry, bool]],
                     params: ObjectiveParams) -> Conditioning:
        return {**super().conditioning(texts, images, params), POOLED: stack(texts, "pooled")}

    def predict(self, transformer: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                conditioning: Conditioning, dtype: torch.dtype) -> torch.Tensor:
        """As the Kandinsky 5 pipelines call their transformer: the latents channels-last (B, F, H, W, C),
        an image as one frame, an image-to-video clip's first frame replaced by its conditioning image;
        where it reads a visual condition, zero condition latents and a mask after them (ones on the
        conditioning image's frame); rows whose texts differ in length apart (it takes no text mask)."""
        import torch

        frames = noisy if noisy.ndim == 5 else noisy.unsqueeze(2)
        conditioned = torch.zeros_like(frames[:, :1])  # the visual condition's mask: the conditioning image's frame
        if REFERENCE_LATENTS in conditioning:
            image = conditioning[REFERENCE_LATENTS][:, 0].to(noisy.device, noisy.dtype)
            frames = torch.cat([image, frames[:, :, 1:]], dim=2)
            conditioned[:, :, 0] = 1
        latents = frames.permute(0, 2, 3, 4, 1)
        out = torch.empty(latents.shape, device=noisy.device)
        if transformer.visual_cond:
            latents = torch.cat([latents, torch.zeros_like(latents), conditioned.permute(0, 2, 3, 4, 1)], dim=-1)
        embeds, mask = (conditioning[name].to(noisy.device) for name in self.text_arguments)
        lengths, pooled = mask.sum(dim=1), conditioning[POOLED].to(noisy.device, dtype)
        sides = (latents.shape[1], latents.shape[2] // 2, latents.shape[3] // 2)
        for length in lengths.unique().tolist():
            rows = (lengths == length).nonzero().flatten()
            out[rows] = transformer(
                hidden_states=latents[rows].to(dtype), encoder_hidden_states=embeds[rows, :length].to(dtype),
                pooled_projections=pooled[rows], timestep=(timesteps[rows] * TIMESTEP_SCALE).to(noisy.device, dtype),
                visual_rope_pos=[torch.arange(side, device=noisy.device) for side in sides],
                text_rope_pos=torch.arange(length, device=noisy.device),
                scale_factor=self.rope_scale(*latents.shape[2:4]), return_dict=False).float()
        out = out.permute(0, 4, 1, 2, 3)
        return out if noisy.ndim == 5 else out.squeeze(2)

    # ---- LoRA
    def original_names(self, transformer: torch.nn.Module) -> OriginalNames:
        """Each Linear under its own name, whole: the original checkpoint's names are diffusers'."""
        return {name: (whole(name),) for name in linear_names(transformer)}

    # ---- rendering
    def prepare_pipeline(self, pipe: Any, sampler: str, objective: FlowMatchingObjective) -> None:
        super().prepare_pipeline(pipe, sampler, objective)
        pipe.resolutions = EveryResolution(pipe.resolutions)

    def render_kwargs(self, settings: Kandinsky5TextSettings, guidance_scale: float,
                      negative_prompt: str) -> dict[str, Any]:
        return {"guidance_scale": guidance_scale, "negative_prompt": negative_prompt,  # "" as the pipeline defaults to
                "max_sequence_length": settings.max_sequence_length}

    # ---- tiny model
    def build_tiny_variant(self, out_dir: Path, variant: FlowVariant) -> Path:
        from .tiny.kandinsky5 import build_tiny_kandinsky5

        return build_tiny_kandinsky5(out_dir)


KANDINSKY5 = Kandinsky5(
    name="kandinsky5", label="Kandinsky 5", pipeline_class="Kandinsky5T2IPipeline",
    components=Components(text=("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"), latent=("vae",),
                          denoiser="transformer"),
    kohya=Kohya("kandinsky5"), latent_patch=2, text_encoder=Kandinsky5TextEncoder,
    block_lists=("text_transformer_blocks", "visual_transformer_blocks"),
)
