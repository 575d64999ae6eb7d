"""The losses of a LoRA trained on several denoisers (train.denoiser `both`: Wan 2.2 A14B's experts,
each with a LoRA file of its own) as one: each denoiser is scored at the evaluate.loss_timesteps of
its own range, as training routes them, and the results merge into what one LoRA scored at all
those timesteps reports, each denoiser's kept under `by_denoiser`.
"""
from __future__ import annotations

from .losses import LossResult


def merged(results: dict[str, dict[str, LossResult]]) -> dict[str, LossResult]:
    """Per split, the denoisers' losses (by denoiser name) as one: by timestep in order and their
    mean, each denoiser's under `by_denoiser`; a run's one denoiser's (named '') as they are."""
    if list(results) == [""]:
        return results[""]
    splits = next(iter(results.values()))
    return {split: _merged_split({name: result[split] for name, result in results.items()}) for split in splits}


def _merged_split(parts: dict[str, LossResult]) -> LossResult:
    by_timestep = dict(sorted(((step, loss) for part in parts.values() for step, loss in part["by_timestep"].items()),
                              key=lambda item: int(item[0])))
    return {"overall": sum(by_timestep.values()) / len(by_timestep), "by_timestep": by_timestep,
            "by_denoiser": parts}
