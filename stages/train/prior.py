"""train.prior_target base_output: a prior sample is scored against the frozen base model's prediction
(differential output preservation, as ai-toolkit and kohya's sd-scripts call it) instead of its data target.

The base prediction is the same denoiser with its adapter switched off (peft's own switch on every
adapter layer, which LoRA, DoRA, LoKr and LoHa share), on the same noisy input, text, timestep and
conditioning, under no_grad: one extra forward over the micro-batch's prior samples, through the
family's own `predict`, so it works for every family. It runs on the unwrapped module (outside DDP:
nothing to synchronise, no gradient), before the adapted forward; gradient checkpointing does not
apply under no_grad, and a quantised base stays as it is (only the adapter layers are switched).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

import torch

if TYPE_CHECKING:
    from lorapipe.stages.families import Family
    from lorapipe.stages.train.data import StepInputs


@contextmanager
def adapter_disabled(model: torch.nn.Module) -> Iterator[None]:
    """`model` computes as its base while inside (every peft adapter layer off), and as before after."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:  # back on, its weights trainable again
            layer.enable_adapters(True)


def base_output_target(family: Family, model: torch.nn.Module, inputs: StepInputs, dtype: torch.dtype) -> torch.Tensor:
    """`inputs.target` with each prior sample's row replaced by the base model's prediction for it
    (inputs already on the model's device; `inputs.prior` set)."""
    rows = inputs.prior.nonzero().squeeze(1)
    prior = inputs if len(rows) == len(inputs.prior) else inputs.rows(rows)  # all prior: no copy
    with torch.no_grad(), adapter_disabled(model):
        base = family.predict(model, prior.noisy, prior.timesteps, prior.conditioning, dtype)
    return inputs.target.index_copy(0, rows, base.to(inputs.target.dtype))
