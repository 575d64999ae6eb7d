"""What the video families (Wan, LTX-2) share: a causal 3-D VAE that keeps a clip's first frame and
packs every `temporal_compression` frames after it into one latent frame, so it takes windows of
k x step + 1 frames (an image is a one-frame clip); clips rendered at the variant's length by
default. `lorapipe demo` trains them (`video`) on the generated clips (stages/demo/clips.py) with
configs/video-demo.yaml.
"""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .flow import FlowFamily, FlowVariant
from .latents import VaePosterior

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class VideoVariant(FlowVariant):
    render_frames: int = 81  # frames a rendered clip has unless evaluate.num_frames says (k x step + 1)


class ClipPosterior(VaePosterior):
    """A 3-D VAE: clips (B, 3, F, H, W) in [-1, 1], or images (B, 3, H, W) as one-frame clips ->
    the posterior's mean and std (B, C, F', H', W') on the CPU."""

    def __call__(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return super().__call__(pixels if pixels.ndim == 5 else pixels.unsqueeze(2))


@dataclass(frozen=True)
class VideoFamily(FlowFamily):
    video: bool = True
    latent_encoder: Callable[[Path, str, str], ClipPosterior] = ClipPosterior

    @abstractmethod
    def temporal_compression(self, model_path: Path) -> int:
        """Clip frames per latent frame after the first (the VAE's temporal downsampling)."""

    def frames_problem(self, model_path: Path, frames: int) -> str | None:
        step = self.temporal_compression(model_path)
        if frames and (frames - 1) % step:
            return f"{self.label} takes windows of {step}k+1 frames (1, {step + 1}, {2 * step + 1}, ...), not {frames}"
        return None

    def clip_kwargs(self, model_path: Path, num_frames: int | None, fps: float) -> dict[str, Any]:
        frames = num_frames or self.bound.render_frames
        problem = self.frames_problem(model_path, frames)
        if problem:
            raise ValueError(f"evaluate.num_frames: {problem}")
        return {"num_frames": frames}


def with_first_frame_condition(noisy: torch.Tensor, condition: torch.Tensor, timesteps: torch.Tensor,
                               tokens_per_frame: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An image-to-video input whose first latent frame is the condition (TI2V-5B, LTX-2): the noisy
    latents (B, C, F, h, w) with their first frame replaced by `condition` (B, C, 1, h, w), and the
    timestep per token (B, F x tokens_per_frame), 0 on the first frame's tokens."""
    import torch

    per_frame = timesteps[:, None].expand(-1, noisy.shape[2]).clone()
    per_frame[:, 0] = 0
    tokens = per_frame[:, :, None].expand(-1, -1, tokens_per_frame).flatten(1)
    return torch.cat([condition.to(noisy.dtype), noisy[:, :, 1:]], dim=2), tokens


def after_first_frame(pred: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the loss scores where the first latent frame is the condition: the frames after it."""
    return pred[:, :, 1:], target[:, :, 1:]
