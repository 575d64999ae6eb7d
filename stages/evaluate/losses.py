"""Denoising loss at fixed timesteps and fixed noise, on cached latents and text embeddings.

For each sample the clean latent is the VAE posterior mean times the scaling factor (no sampling,
so the number does not move between runs), noised at every requested timestep with noise drawn
from a generator seeded by (loss_seed, the sample's content id), and compared with what the
scheduler's prediction type asks the UNet to predict. Seeding by content rather than position
keeps a sample's noise the same when other samples join or leave the split (retraining on a
growing dataset), and rather than by file name when its file is renamed.
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import torch

from stages.encoded import EncodedData, Sample

if TYPE_CHECKING:
    from diffusers import DDPMScheduler, UNet2DConditionModel

LossResult = dict[str, Any]  # {"overall": float, "by_timestep": {"<t>": float}}


def sample_digest(loss_seed: int, content_id: str) -> bytes:
    return hashlib.sha256(f"{loss_seed}:{content_id}".encode()).digest()


def fixed_noise(loss_seed: int, content_id: str, shape: tuple[int, ...]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(int.from_bytes(sample_digest(loss_seed, content_id)[:8], "big"))
    return torch.randn(shape, generator=generator)


def loss_subset(samples: list[Sample], limit: int | None, loss_seed: int) -> list[Sample]:
    """At most `limit` samples: those whose hash of (loss_seed, content id) is smallest, so the
    subset changes little as the dataset grows and evaluation costs the same at any dataset size."""
    if limit is None or len(samples) <= limit:
        return samples
    return sorted(samples, key=lambda s: sample_digest(loss_seed, s.content_id))[:limit]


def _target(
    scheduler: DDPMScheduler, clean: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor
) -> torch.Tensor:
    kind = scheduler.config.prediction_type
    if kind == "epsilon":
        return noise
    if kind == "v_prediction":
        return scheduler.get_velocity(clean, noise, timesteps)
    if kind == "sample":
        return clean
    raise ValueError(f"scheduler prediction_type {kind!r} is not supported: expected epsilon, v_prediction or sample")


def _added_cond(
    unet: UNet2DConditionModel, sample: Sample, text: dict[str, torch.Tensor], n: int
) -> dict[str, torch.Tensor] | None:
    """SDXL's extra conditioning: pooled text embedding and (original size, crop top-left, size)."""
    if unet.config.addition_embed_type != "text_time":
        return None
    left, top, _, _ = sample.crop_box
    time_ids = torch.tensor([[*sample.original_size, top, left, *sample.size]], dtype=torch.float32)
    return {"text_embeds": text["pooled"].float().expand(n, -1), "time_ids": time_ids.expand(n, -1)}


@torch.inference_mode()
def denoising_loss(
    unet: UNet2DConditionModel, noise_scheduler: DDPMScheduler, encoded: EncodedData, samples: list[Sample],
    timesteps: list[int], loss_seed: int,
) -> LossResult:
    """Mean squared error of `unet` over `samples` at each of `timesteps`, and their mean."""
    device, dtype = unet.device, unet.dtype
    t = torch.tensor(timesteps, dtype=torch.long)
    scaling = encoded.index["vae_scaling_factor"]
    total = torch.zeros(len(timesteps), dtype=torch.float64)
    for sample in samples:  # one UNet call per sample, batched over timesteps (buckets may differ)
        mean, _ = encoded.latent(sample)
        clean = (mean.float() * scaling).expand(len(timesteps), *mean.shape)
        noise = fixed_noise(loss_seed, sample.content_id, tuple(clean.shape))
        noisy = noise_scheduler.add_noise(clean, noise, t)
        text = encoded.text(sample)
        hidden = text["hidden_states"].float().expand(len(timesteps), -1, -1)
        added = _added_cond(unet, sample, text, len(timesteps))
        pred = unet(
            noisy.to(device, dtype), t.to(device), encoder_hidden_states=hidden.to(device, dtype),
            added_cond_kwargs={k: v.to(device, dtype) for k, v in added.items()} if added else None,
        ).sample
        error = (pred.float().cpu() - _target(noise_scheduler, clean, noise, t)) ** 2
        total += error.mean(dim=tuple(range(1, error.ndim))).double()
    per_t = total / len(samples)
    return {
        "overall": per_t.mean().item(),
        "by_timestep": {str(step): value.item() for step, value in zip(timesteps, per_t)},
    }
