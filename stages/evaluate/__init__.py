"""Evaluate: sample grid (base vs LoRA), denoising loss on held-out and train data, CLIP score.

Reads:  the base model folder (through its family: stages/families); the train artifact (`pytorch_lora_weights.safetensors`, and
        `checkpoints/step-N/pytorch_lora_weights.safetensors` for every retained checkpoint; one of each
        per denoiser, named by it, for a run that trained several: each loads into its denoiser);
        the encode artifact and its sample store (cached latents and text embeddings).
Renders with the family's pipeline (model_index.json's class, or a modular folder's ModularPipeline:
stages/families/modular.py), sampler and defaults for steps and guidance; scores the loss with the family's objective as the LoRA was trained (train_config.json).
Writes: grid.png, metrics.json, report.md; with checkpoints, checkpoint_losses.json and
        checkpoint_loss.png. All byte-deterministic for the same inputs and params.
Key:    VERSION, EvalParams, and the digests of the base model, encode and train artifacts; so
        changing a prompt, seed, scale, sampler or metric setting reruns evaluate only.

It runs where its placement says (worker.py, stages/processes/placement.py): in a run that trains, in the
warm process that trained the LoRA, else in the calling process. The pipeline is loaded once.
Base images and base losses come first; then the LoRA is loaded as an adapter and rendered at
each scale. Losses use the LoRA at scale 1, the strength it was trained at.
"""
from __future__ import annotations

from pathlib import Path

from lorapipe.cache.store import Built
from lorapipe.stages.contract import Log
from lorapipe.stages.processes.placement import Placement, Where, place

from .params import LOCAL_PATHS, OUTPUT_FILES, VERSION, EvalInputs, EvalOptions, EvalParams

__all__ = ["VERSION", "OUTPUT_FILES", "EvalParams", "EvalOptions", "EvalInputs", "run", "where", "LOCAL_PATHS"]


def run(params: EvalParams, inputs: EvalInputs, out_dir: Path, work_dir: Path,
        options: EvalOptions = EvalOptions(), log: Log = print, placement: Placement | None = None) -> Built:
    """Write the evaluation of inputs.train_dir's LoRA into out_dir (see evaluation.run) where
    `placement` says (the plan's; default: the calling process). torch and diffusers load only there."""
    from .worker import evaluate_at

    return evaluate_at(placement or place(where(options)), params, inputs, out_dir, work_dir, options, log)


def where(options: EvalOptions) -> Where:
    """Where evaluate's job runs (stages/processes/placement.py): one process, the calling one (or the warm process)."""
    return Where()
