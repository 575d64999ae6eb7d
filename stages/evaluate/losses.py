"""Denoising loss at fixed timesteps and fixed noise, on cached latents and text embeddings.

For each sample the clean latent is the VAE posterior mean under the encode artifact's latent
normalisation (no sampling, so the number does not move between runs), noised at every requested
timestep with noise drawn from a generator seeded by (loss_seed, the sample's content id), and
scored against the target of the family's objective: the one definition training uses, so train
and evaluate cannot disagree on what the model predicts. Seeding by content rather than position
keeps a sample's noise the same when other samples join or leave the split (retraining on a
growing dataset), and rather than by file name when its file is renamed.

The score is always the plain, unweighted mean squared error over every latent element, whatever the
training loss was (train.loss_type, min-SNR or debiased weights, loss masks): so held-out losses
compare across runs with different loss settings, and the base model is scored the same way.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lorapipe.stages.encoded import EncodedData, Sample
from lorapipe.stages.families.objectives import LossFunction

if TYPE_CHECKING:
    from lorapipe.stages.families import Family, ObjectiveParams
    from lorapipe.stages.families.objectives import Objective

LossResult = dict[str, Any]  # {"overall": float, "by_timestep": {"<t>": float}}
MSE = LossFunction("mse")  # whatever train.loss_type was: a number comparable across runs and with the base


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


@dataclass(frozen=True)
class Scoring:
    """What a loss is measured with: the family, its objective for the model as trained, and the
    trained objective settings (the conditioning reads them: Flux.1 dev's guidance)."""

    family: Family
    objective: Objective
    params: ObjectiveParams


@torch.inference_mode()
def denoising_loss(denoiser: torch.nn.Module, scoring: Scoring, encoded: EncodedData, samples: list[Sample],
                   timesteps: list[int], loss_seed: int) -> LossResult:
    """Mean squared error (unweighted) of `denoiser` over `samples` at each of `timesteps`, and their mean."""
    family, objective = scoring.family, scoring.objective
    device, dtype, n = denoiser.device, denoiser.dtype, len(timesteps)
    t = objective.fixed_timesteps(timesteps)
    total = torch.zeros(n, dtype=torch.float64)
    for sample in samples:  # one denoiser call per sample, batched over timesteps (buckets may differ)
        mean, _ = encoded.latent(sample)
        clean = encoded.normalisation.apply(mean.float().unsqueeze(0))
        clean = clean.expand(n, *clean.shape[1:])
        noised = objective.noised(clean, fixed_noise(loss_seed, sample.content_id, tuple(clean.shape)), t)
        conditioning = family.conditioning([encoded.text(sample)], [(sample, False)], scoring.params)
        references = encoded.reference_conditioning(sample) or {}  # an edit pair's: its loss is the edit's
        conditioning |= {name: tensor.unsqueeze(0) for name, tensor in references.items()}
        conditioning = {k: v.expand(n, *v.shape[1:]).to(device) for k, v in conditioning.items()}
        pred = family.predict(denoiser, noised.noisy.to(device), noised.timesteps.to(device), conditioning, dtype)
        total += MSE.per_sample(*family.loss_region(pred.cpu(), noised.target)).double()
    per_t = total / len(samples)
    return {
        "overall": per_t.mean().item(),
        "by_timestep": {str(step): value.item() for step, value in zip(timesteps, per_t)},
    }
