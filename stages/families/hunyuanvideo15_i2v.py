"""HunyuanVideo 1.5 image-to-video (HunyuanVideo15ImageToVideoPipeline): a clip conditioned on its
first frame.

As the pipeline builds the condition: the image alone through the VAE (the posterior's mode, the
mean), normalised by the scaling_factor, is the first frame of the condition latents, zeros after it,
with a mask of ones on that frame; the transformer reads the latents, those condition latents and
the mask on channels (as text-to-video reads zeros there), and the image's SigLIP embedding (the
vision model's last_hidden_state through its feature_extractor, the pipeline's encode_image) as
image_embeds. The conditioning image's record (ImageCondition, not padded) holds that latent and
embedding; the text, the VAE and the LoRA loader are text-to-video's, the noisy first frame is
denoised and scored as in the pipeline.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .base import IMAGE_EMBEDS, REFERENCE_LATENTS, Conditioning, ImageCondition
from .hunyuanvideo15 import HUNYUANVIDEO15, HunyuanVideo15
from .objectives import FlowMatchingObjective
from .video import VideoVariant
from .wan_i2v import ClipVisionEmbedder

if TYPE_CHECKING:
    import torch

I2V_VARIANTS = (VideoVariant("1.5-i2v", "hunyuanvideo1.5-i2v", 50, 6.0, max_sequence_length=1000,
                             render_frames=121),)


class SiglipEmbedder(ClipVisionEmbedder):
    """HunyuanVideo15ImageToVideoPipeline.encode_image on placed pixels: its feature_extractor, the
    SigLIP vision model's last_hidden_state (after its post-layernorm)."""

    processor_component = "feature_extractor"

    def states(self, inputs: Any) -> torch.Tensor:
        return self.encoder(**inputs).last_hidden_state


def _at_size(call: Callable[..., Any]) -> Callable[..., Any]:
    """The pipeline's call taking height and width: the size its video processor picks for the image."""
    def sized(pipe: Any, *args: Any, height: int | None = None, width: int | None = None, **kwargs: Any) -> Any:
        if height is not None and width is not None:
            pipe.video_processor.calculate_default_height_width = lambda *_, **__: (height, width)
        return call(pipe, *args, **kwargs)

    return sized


@dataclass(frozen=True)
class HunyuanVideo15I2V(HunyuanVideo15):
    variants: tuple[VideoVariant, ...] = I2V_VARIANTS
    max_references: int = 1
    image_condition: ImageCondition | None = ImageCondition(padded=False, embedder=SiglipEmbedder)
    renders_without_references: bool = False

    def image_inputs(self, transformer: torch.nn.Module, noisy: torch.Tensor, conditioning: Conditioning,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The pipeline's prepare_cond_latents_and_mask and encode_image: the image's latent as the
        first of the condition's frames, zeros after, the mask's ones on it; its embedding."""
        import torch

        reference = conditioning[REFERENCE_LATENTS][:, 0, :, :1].to(noisy.device, dtype)
        batch, _, frames, height, width = noisy.shape
        latents = torch.cat([reference, reference.new_zeros(*reference.shape[:2], frames - 1, height, width)], dim=2)
        mask = torch.zeros(batch, 1, frames, height, width, device=noisy.device, dtype=dtype)
        mask[:, :, 0] = 1
        return torch.cat([latents, mask], dim=1), conditioning[IMAGE_EMBEDS][:, 0].to(noisy.device, dtype)

    def prepare_pipeline(self, pipe: Any, sampler: str, objective: FlowMatchingObjective) -> None:
        """Text-to-video's, rendering at the height and width asked: the pipeline takes none and
        renders at the aspect bucket of its transformer's target_size nearest the image's."""
        super().prepare_pipeline(pipe, sampler, objective)
        pipe.__class__ = type(f"{type(pipe).__name__}AtSize", (type(pipe),),
                              {"__call__": _at_size(type(pipe).__call__)})

    def build_tiny_variant(self, out_dir: Path, variant: VideoVariant) -> Path:
        from .tiny.hunyuanvideo15 import build_tiny_hunyuanvideo15

        return build_tiny_hunyuanvideo15(out_dir, image_to_video=True)


HUNYUANVIDEO15_I2V = HunyuanVideo15I2V(
    name="hunyuanvideo1.5-i2v", label="HunyuanVideo 1.5 I2V", pipeline_class="HunyuanVideo15ImageToVideoPipeline",
    components=replace(HUNYUANVIDEO15.components, image=("image_encoder", "feature_extractor")),
    kohya=HUNYUANVIDEO15.kohya, sequence_patch=HUNYUANVIDEO15.sequence_patch, text_encoder=HUNYUANVIDEO15.text_encoder,
    latent_encoder=HUNYUANVIDEO15.latent_encoder, original_formats=HUNYUANVIDEO15.original_formats,
    clip_fps=HUNYUANVIDEO15.clip_fps, block_lists=HUNYUANVIDEO15.block_lists,
)
