"""The denoisers a run trains: one, or with train.denoiser `both` every denoiser of a model that has
several (Wan 2.2 A14B's high- and low-noise experts), each with a LoRA of its own, in one process
over one encode.

Routing: a whole optimizer step goes to one denoiser. Its noise level is drawn from the
unconditioned sampling distribution by a generator seeded from (seed, step) alone, and the step
trains the denoiser whose range holds it; every sample of the step then draws its own noise level
from that denoiser's range (the distribution conditioned on it, as a one-denoiser run draws). So
each denoiser trains on the share of steps the model's noise levels give it, with the distribution
its own run would have, every rank routes a step alike (DDP never waits on a model another rank did
not run), gradient accumulation stays within one denoiser, and a resumed run routes as the first
did. musubi-tuner routes the same way (a batch follows its first sample's draw), but trains one
LoRA on both experts; here each expert has its own, as ComfyUI workflows load them.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lorapipe.cache.errors import UserError
from lorapipe.stages.lora_formats.lora_folder import expert_file
from lorapipe.stages.train.data import derived_seed

if TYPE_CHECKING:
    from lorapipe.stages.families import Family
    from lorapipe.stages.families.objectives import FlowMatchingObjective, Objective
    from lorapipe.stages.train.block_swap import BlockSwap
    from lorapipe.stages.train.params import TrainParams
    from lorapipe.stages.train.trained_adapter import TrainedAdapter

UNSIZED = (1, 1, 1, 1)  # a draw's latent shape where the shift does not depend on the size


@dataclass
class Expert:
    """One trained denoiser: its name ('' when a run trains one), its bound family and objective (its
    noise levels), and, once set up, its module (prepared by accelerate), adapter, block swap and,
    with train.prior_target base_output, the unwrapped module whose adapter-off output is the prior's target."""

    name: str
    family: Family
    objective: Objective
    denoiser: torch.nn.Module | None = None
    adapter: TrainedAdapter | None = None
    block_swap: BlockSwap | None = None
    base_output_of: torch.nn.Module | None = None

    def folder(self, root: Path) -> Path:
        """Its part of a checkpoint or export folder (the folder itself for a run's one denoiser)."""
        return Path(root) / self.name


def experts_of(family: Family, choice: str | None, model_path: Path, params: TrainParams) -> list[Expert]:
    """The denoisers train.denoiser trains, each with its objective."""
    return [Expert(name, bound, bound.objective(model_path, params))
            for name, bound in family.trained_denoisers(choice).items()]


def check_routable(objective: FlowMatchingObjective) -> None:
    """Several denoisers are routed by a draw made before a step's sizes are known: refuse a shift
    that depends on them."""
    shift = objective.sampling.shift
    if shift not in ("none", "static"):
        raise UserError(f"train.timestep_sampling.shift: {shift} depends on the sample's size, but with"
                        " train.denoiser both a step's denoiser is drawn before its samples are read; use static")


def routed(experts: list[Expert], unconditioned: FlowMatchingObjective, seed: int, step: int) -> Expert:
    """The denoiser that trains optimizer step `step` (the module docstring's rule)."""
    if len(experts) == 1:
        return experts[0]
    rng = torch.Generator().manual_seed(derived_seed(seed, "denoiser", step))
    sigma = unconditioned.sample_timesteps(UNSIZED, rng)
    return next(expert for expert in experts if expert.objective.in_range(sigma).all())


def export_expert(expert: Expert, denoiser: torch.nn.Module, out_dir: Path, provenance: dict[str, str],
                  kohya_metadata: dict[str, str]) -> list[Path]:
    """Its exported files in out_dir (and ema/), each named for its denoiser when there are several
    (lora_folder.expert_file): written into a folder of their own, then moved beside the others."""
    if not expert.name:
        return expert.adapter.export(denoiser, out_dir, provenance, kohya_metadata)
    own = expert.folder(out_dir)
    own.mkdir()
    written = []
    for file in expert.adapter.export(denoiser, own, {**provenance, "lorapipe.denoiser": expert.name},
                                      kohya_metadata):
        moved = out_dir / file.parent.relative_to(own) / expert_file(file.name, expert.name)
        moved.parent.mkdir(exist_ok=True)
        written.append(file.rename(moved))
    shutil.rmtree(own)
    return written
