"""Kandinsky 5 text-to-video: the text-to-image family's transformer, text records and denoiser call
(kandinsky5.py) with the pipeline's video template, on the latents of HunyuanVideo's causal 3-D VAE.

As Kandinsky5T2VPipeline does it: the caption in its video template, Qwen2.5-VL's last hidden state
after the template's first 128 tokens (at most 512 kept), CLIP's pooled output; records (16, F', H/8,
W/8) for 4k + 1 frames (k + 1 latent frames), normalised by the VAE's scaling_factor; the rope scaled
by the size (2 on each side between 480 and 854 px, else 3.16) and, where the transformer reads a
visual condition, zero condition latents and mask after the noisy ones. A transformer with sparse
(`nabla`) attention, which needs flex attention, is refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from lorapipe.cache.errors import UserError

from .base import Kohya
from .folders import component_config
from .flow import FlowFamily
from .kandinsky5 import KANDINSKY5, Kandinsky5
from .objectives import FlowMatchingObjective
from .video import ClipPosterior, VideoFamily, VideoVariant

if TYPE_CHECKING:
    import torch

VIDEO_TEMPLATE = "\n".join((  # Kandinsky5T2VPipeline.prompt_template
    "<|im_start|>system\nYou are a prompt engineer. Describe the video in detail.",
    "Describe how the camera moves or shakes, describe the zoom and view angle, whether it follows the objects.",
    "Describe the location of the video, main characters or objects and their action.",
    "Describe the dynamism of the video and presented actions.",
    "Name the visual style of the video: whether it is a professional footage, user generated content, some kind of"
    " animation, video game or scren content.",
    "Describe the visual effects, postprocessing and transitions if they are presented in the video.",
    "Pay attention to the order of key actions shown in the scene.<|im_end|>",
    "<|im_start|>user\n{}<|im_end|>",
))
VIDEO_TEMPLATE_TOKENS = 128  # Kandinsky5T2VPipeline.prompt_template_encode_start_idx
PIXELS_PER_LATENT = 8  # the pipeline's vae_scale_factor_spatial, its VAE's spatial_compression_ratio

VARIANTS = (VideoVariant("5.0-t2v-lite", "kandinsky5-video", 50, 5.0, render_frames=121),)


def video_rope_scale(latent_height: int, latent_width: int) -> tuple[float, float, float]:
    """Kandinsky5T2VPipeline's rope scale for the video's size."""
    from diffusers import Kandinsky5T2VPipeline

    return Kandinsky5T2VPipeline._get_scale_factor(None, latent_height * PIXELS_PER_LATENT,
                                                   latent_width * PIXELS_PER_LATENT)


@dataclass(frozen=True)
class Kandinsky5Video(Kandinsky5, VideoFamily):
    variants: tuple[VideoVariant, ...] = VARIANTS
    template: str = VIDEO_TEMPLATE
    template_tokens: int = VIDEO_TEMPLATE_TOKENS
    rope_scale: Callable[[int, int], tuple[float, float, float]] = video_rope_scale
    video: bool = True  # set again: Kandinsky5's fields, an image family's, come after VideoFamily's
    latent_encoder: Callable[[Path, str, str], ClipPosterior] = ClipPosterior

    def temporal_compression(self, model_path: Path) -> int:
        return component_config(model_path, self.components.latent[0]).get("temporal_compression_ratio", 4)

    def load_denoiser(self, model_path: Path, dtype: torch.dtype) -> torch.nn.Module:
        transformer = super().load_denoiser(model_path, dtype)
        attention = transformer.config.attention_type
        if attention != "regular":
            raise UserError(f"{model_path}/transformer/config.json: attention_type {attention!r} (sparse attention)"
                            " is not trained here; train a model with regular attention")
        return transformer

    def prepare_pipeline(self, pipe: Any, sampler: str, objective: FlowMatchingObjective) -> None:
        FlowFamily.prepare_pipeline(self, pipe, sampler, objective)  # it renders at any size asked

    def build_tiny_variant(self, out_dir: Path, variant: VideoVariant) -> Path:
        from .tiny.kandinsky5 import build_tiny_kandinsky5_video

        return build_tiny_kandinsky5_video(out_dir)


KANDINSKY5_VIDEO = Kandinsky5Video(
    name="kandinsky5-video", label="Kandinsky 5 video", pipeline_class="Kandinsky5T2VPipeline",
    components=KANDINSKY5.components, kohya=Kohya("kandinsky5"), latent_patch=2,
    text_encoder=KANDINSKY5.text_encoder, block_lists=KANDINSKY5.block_lists, clip_fps=24,
)
