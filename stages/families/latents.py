"""Latent records and their normalisation.

A latent record holds the VAE posterior unscaled (mean and std, stages/encoded.py), so a change of
normalisation never re-encodes an image. The normalisation is data read from the VAE at encode time
and recorded in the encode index, so train and evaluate apply the one the records were made with,
and its values reach the train key through the encode artifact's digest. Records are (C, H, W) for
the image families (a video VAE's one frame, Qwen-Image's, is squeezed out by its encoder) and
(C, F, H, W) for the video families (Wan, LTX-2): every kind applies per channel to a batch of either rank.

Kinds, told apart by `kind`:
- `scale_shift` (SD, Flux.1, Z-Image): `(z - shift) * scale` from the VAE config;
- `channel_mean_std` (Qwen-Image, Wan, LTX-2): `(z - mean_c) * (1 / std_c)` from the config's latents_mean/std
  (LTX-2: its VAE's buffers, std divided by its scaling_factor);
- `patched_batch_norm` (Flux.2, ERNIE-Image): z patchified 2x2 (C -> 4C channels, half the sides), then
  `(z - running_mean_c) / sqrt(running_var_c + eps)` with the VAE's batch-norm statistics (weights,
  not config: read from its safetensors). Its output layout is the patchified one: the objective and
  the denoiser see (4C, H/2, W/2) latents, so noise is drawn after `apply`;
- `patch_major_batch_norm` (Ideogram 4): the same with the patched channels ordered (row, column,
  channel), the order its VAE's statistics and its transformer's tokens use.
"""
from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field, TypeAdapter

from lorapipe.stages.contract import Frozen

from .folders import component_config, component_tensors, load_component

if TYPE_CHECKING:
    import torch


class ScaleShift(Frozen):
    """`(z - shift) * scale`, with the VAE config's `shift_factor` and `scaling_factor`."""

    kind: Literal["scale_shift"] = "scale_shift"
    scale: float
    shift: float = 0.0

    def apply(self, latents: torch.Tensor) -> torch.Tensor:
        return (latents - self.shift) * self.scale


def _per_channel(values: tuple[float, ...], latents: torch.Tensor) -> torch.Tensor:
    """`values` shaped to broadcast over the channel axis of (B, C, ...) latents of any rank."""
    import torch

    return torch.tensor(values).view(1, -1, *[1] * (latents.ndim - 2)).to(latents.device, latents.dtype)


class ChannelMeanStd(Frozen):
    """`(z - mean) * (1 / std)` per channel, as the QwenImage and Wan pipelines compute it."""

    kind: Literal["channel_mean_std"] = "channel_mean_std"
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def apply(self, latents: torch.Tensor) -> torch.Tensor:
        return (latents - _per_channel(self.mean, latents)) * (1.0 / _per_channel(self.std, latents))


class PatchedBatchNorm(Frozen):
    """2x2 patchify, then the VAE's batch-norm running statistics per patched channel (Flux.2)."""

    kind: Literal["patched_batch_norm"] = "patched_batch_norm"
    running_mean: tuple[float, ...]
    running_var: tuple[float, ...]
    eps: float

    def patchify(self, latents: torch.Tensor) -> torch.Tensor:
        from diffusers import Flux2KleinPipeline

        return Flux2KleinPipeline._patchify_latents(latents)

    def apply(self, latents: torch.Tensor) -> torch.Tensor:
        import torch

        patched = self.patchify(latents)
        std = torch.sqrt(_per_channel(self.running_var, patched) + self.eps)
        return (patched - _per_channel(self.running_mean, patched)) / std


class PatchMajorBatchNorm(PatchedBatchNorm):
    """PatchedBatchNorm with (row, column, channel) patched channels (Ideogram 4)."""

    kind: Literal["patch_major_batch_norm"] = "patch_major_batch_norm"

    def patchify(self, latents: torch.Tensor) -> torch.Tensor:
        b, c, h, w = latents.shape
        patched = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 3, 5, 1, 2, 4)
        return patched.reshape(b, 4 * c, h // 2, w // 2)


LatentNormalisation = Annotated[ScaleShift | ChannelMeanStd | PatchedBatchNorm | PatchMajorBatchNorm,
                                Field(discriminator="kind")]
_NORMALISATION = TypeAdapter(LatentNormalisation)


def scale_shift_of(model_path: Path, vae: str) -> ScaleShift:
    """The VAE config's scale and shift (SD's configs predate `shift_factor`: 0; `scaling_factor`
    defaults to SD's 0.18215, as diffusers' AutoencoderKL does)."""
    config = component_config(model_path, vae)
    return ScaleShift(scale=config.get("scaling_factor", 0.18215), shift=config.get("shift_factor") or 0.0)


def channel_mean_std_of(model_path: Path, vae: str) -> ChannelMeanStd:
    config = component_config(model_path, vae)
    return ChannelMeanStd(mean=tuple(config["latents_mean"]), std=tuple(config["latents_std"]))


def patched_batch_norm_of(model_path: Path, vae: str, kind: type[PatchedBatchNorm] = PatchedBatchNorm,
                          eps: float | None = None) -> PatchedBatchNorm:
    """`eps`: the pipeline's own, where it does not read the VAE config's `batch_norm_eps`."""
    config = component_config(model_path, vae)
    stats = component_tensors(model_path, vae, ("bn.running_mean", "bn.running_var"))
    return kind(running_mean=tuple(stats["bn.running_mean"].tolist()),
                running_var=tuple(stats["bn.running_var"].tolist()),
                eps=config.get("batch_norm_eps", 1e-4) if eps is None else eps)


def normalisation_from_json(value: dict) -> LatentNormalisation:
    return _NORMALISATION.validate_python(value)


class VaePosterior:
    """A diffusers VAE's encoder: pixels (B, 3, H, W) in [-1, 1] -> the posterior's mean and std,
    (B, C, h, w) on the CPU. `one_frame`: a video VAE, given and giving one frame."""

    def __init__(self, model_path: Path, vae: str, device: str, one_frame: bool = False):
        self.vae = load_component(model_path, vae).eval().requires_grad_(False).to(device)
        self.device, self.one_frame = device, one_frame

    def __call__(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pixels = pixels.to(self.device)
        dist = self.vae.encode(pixels.unsqueeze(2) if self.one_frame else pixels).latent_dist
        mean, std = dist.mean, dist.std
        if self.one_frame:
            mean, std = mean.squeeze(2), std.squeeze(2)
        return mean.cpu(), std.cpu()


ONE_FRAME = partial(VaePosterior, one_frame=True)  # a video VAE encoding images (Qwen-Image's)
