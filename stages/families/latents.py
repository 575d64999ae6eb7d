"""Latent records and their normalisation.

A latent record holds the VAE posterior unscaled (mean and std, stages/encoded.py), so a change of
normalisation never re-encodes an image. The normalisation is data read from the VAE's config at
encode time and recorded in the encode index, so train and evaluate apply the one the records were
made with, and its values reach the train key through the encode artifact's digest.

Flux.1, Z-Image and SD use `(z - shift) * scale`. Later families add their own kinds here (per-channel
mean/std for Qwen-Image, the VAE's batch-norm statistics after a 2x2 patchify for Flux.2) as further
members of the `LatentNormalisation` union, told apart by `kind`.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from stages.contract import Frozen

from .folders import component_config, load_component

if TYPE_CHECKING:
    import torch


class ScaleShift(Frozen):
    """`(z - shift) * scale`, with the VAE config's `shift_factor` and `scaling_factor`."""

    kind: Literal["scale_shift"] = "scale_shift"
    scale: float
    shift: float = 0.0

    def apply(self, latents: torch.Tensor) -> torch.Tensor:
        return (latents - self.shift) * self.scale


LatentNormalisation = ScaleShift


def scale_shift_of(model_path: Path, vae: str) -> ScaleShift:
    """The VAE config's scale and shift (SD's configs predate `shift_factor`: 0; `scaling_factor`
    defaults to SD's 0.18215, as diffusers' AutoencoderKL does)."""
    config = component_config(model_path, vae)
    return ScaleShift(scale=config.get("scaling_factor", 0.18215), shift=config.get("shift_factor") or 0.0)


def normalisation_from_json(value: dict) -> LatentNormalisation:
    return ScaleShift.model_validate(value)


class VaePosterior:
    """A diffusers VAE's encoder: pixels in [-1, 1] -> the posterior's mean and std, on the CPU."""

    def __init__(self, model_path: Path, vae: str, device: str):
        self.vae = load_component(model_path, vae).eval().requires_grad_(False).to(device)
        self.device = device

    def __call__(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dist = self.vae.encode(pixels.to(self.device)).latent_dist
        return dist.mean.cpu(), dist.std.cpu()
