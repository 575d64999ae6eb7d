"""Kandinsky 5 image-to-video: the text-to-video family (kandinsky5_video.py) conditioned on a clip's
first frame, as Kandinsky5I2VPipeline does it.

The conditioning image alone through the VAE (its record: ImageCondition, not padded), scaled as the
clip's latents, replaces the first latent frame of the noisy clip, and the visual condition's mask
is one on that frame (its condition latents stay zero); every token reads the clip's timestep. The
pipeline never denoises the first frame, so the loss scores the frames after it. Renders take the
held-out window's first frame as `image`, and are of at least 17 frames: after denoising, the pipeline
rescales the first 4 latent frames to the mean and spread of those after them
(`normalize_first_frame`), and a clip of no latent frame after them renders NaN, a black clip.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .base import ImageCondition
from .kandinsky5_video import KANDINSKY5_VIDEO, Kandinsky5Video
from .video import VideoVariant, after_first_frame

if TYPE_CHECKING:
    from pathlib import Path

    import torch


NORMALISED_FIRST_FRAMES = 4  # Kandinsky5I2VPipeline.normalize_first_frame's nFr


@dataclass(frozen=True)
class Kandinsky5I2V(Kandinsky5Video):
    max_references: int = 1
    image_condition: ImageCondition | None = ImageCondition(padded=False)
    renders_without_references: bool = False

    def loss_region(self, pred: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return after_first_frame(pred, target)

    def clip_kwargs(self, model_path: Path, num_frames: int | None, fps: float) -> dict[str, Any]:
        kwargs = super().clip_kwargs(model_path, num_frames, fps)
        least = NORMALISED_FIRST_FRAMES * self.temporal_compression(model_path) + 1
        if kwargs["num_frames"] < least:
            raise ValueError(f"evaluate.num_frames: {self.label} renders clips of at least {least} frames"
                             f" (its pipeline rescales the first {NORMALISED_FIRST_FRAMES} latent frames to those"
                             f" after them), not {kwargs['num_frames']}")
        return kwargs

    def build_tiny_variant(self, out_dir: Path, variant: VideoVariant) -> Path:
        from .tiny.kandinsky5 import build_tiny_kandinsky5_video

        return build_tiny_kandinsky5_video(out_dir, "Kandinsky5I2VPipeline")


KANDINSKY5_I2V = Kandinsky5I2V(
    name="kandinsky5-i2v", label="Kandinsky 5 I2V", pipeline_class="Kandinsky5I2VPipeline",
    variants=(VideoVariant("5.0-i2v-lite", "kandinsky5-i2v", 50, 5.0, render_frames=121),),
    components=KANDINSKY5_VIDEO.components, kohya=KANDINSKY5_VIDEO.kohya, latent_patch=2,
    text_encoder=KANDINSKY5_VIDEO.text_encoder, block_lists=KANDINSKY5_VIDEO.block_lists, clip_fps=24,
)
