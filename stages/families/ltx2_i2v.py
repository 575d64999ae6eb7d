"""LTX-2 image-to-video (LTX2ImageToVideoPipeline): a clip conditioned on its first frame.

As LTX2ImageToVideoPipeline.prepare_latents builds the condition: the image alone through the VAE
(the posterior's mean), normalised, is the first latent frame, kept clean: its tokens take timestep
0 (the pipeline's conditioning mask) while the others take the step's, and the loss scores the frames
after it. The pipeline normalises that latent without the VAE's scaling_factor, which the clip's
latents take (LTX-2's is 1.0; the tiny model's is not): predict undoes the factor on the condition
as the records carry it. Everything else (text, packing, the audio placeholder) is LTX-2's.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from .base import REFERENCE_LATENTS, Conditioning, ImageCondition
from .folders import component_config
from .ltx2 import LTX2, TIMESTEP_SCALE, LTX2Family
from .video import VideoVariant, after_first_frame, with_first_frame_condition

if TYPE_CHECKING:
    import torch

I2V_VARIANTS = (VideoVariant("2-i2v", "ltx2-i2v", 30, 3.0, max_sequence_length=1024, render_frames=121),)


@dataclass(frozen=True)
class LTX2I2V(LTX2Family):
    variants: tuple[VideoVariant, ...] = I2V_VARIANTS
    max_references: int = 1
    image_condition: ImageCondition | None = ImageCondition(padded=False)
    renders_without_references: bool = False
    condition_scale: float = 1.0  # 1 / the VAE's scaling_factor (for_model): the pipeline leaves it off the condition

    def for_model(self, model_path: Path) -> LTX2I2V:
        scaling = component_config(model_path, self.components.latent[0]).get("scaling_factor", 1.0)
        return replace(super().for_model(model_path), condition_scale=1 / scaling)

    def predict(self, transformer: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                conditioning: Conditioning, dtype: torch.dtype) -> torch.Tensor:
        """LTX-2's call with the condition as the first latent frame, its tokens at timestep 0."""
        t = (timesteps.float() * TIMESTEP_SCALE).to(noisy.device)
        reference = conditioning[REFERENCE_LATENTS][:, 0].to(noisy.device) * self.condition_scale
        hidden, video_t = with_first_frame_condition(noisy, reference, t, noisy.shape[3] * noisy.shape[4])
        return self.transformer_call(transformer, hidden, t, video_t, conditioning, dtype)

    def loss_region(self, pred: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return after_first_frame(pred, target)

    def build_tiny_variant(self, out_dir: Path, variant: VideoVariant) -> Path:
        from .tiny.ltx2 import build_tiny_ltx2

        return build_tiny_ltx2(out_dir, image_to_video=True)


LTX2_I2V = LTX2I2V(
    name="ltx2-i2v", label="LTX-2 I2V", pipeline_class="LTX2ImageToVideoPipeline", components=LTX2.components,
    kohya=LTX2.kohya, sequence_patch=LTX2.sequence_patch, text_encoder=LTX2.text_encoder,
    normalisation_of=LTX2.normalisation_of, clip_fps=LTX2.clip_fps, block_lists=LTX2.block_lists,
    checkpoint_prefixes=LTX2.checkpoint_prefixes,
)
