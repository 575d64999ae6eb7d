"""Optional libraries a training process does not load unless its job uses them.

diffusers imports bitsandbytes and torchao whenever they are installed (diffusers.quantizers, on
`import diffusers`), and bitsandbytes compiles its kernels with torch.compile when imported, which
loads torch._inductor: together about a quarter of a training process's imports on two cores
(BENCHMARKS.md, start-up). The stage names in the process's environment (HIDDEN_ENV) those its job
does not use (train.base_quantization, train.optimizer), and the process hides them before anything
imports diffusers, by `sys.modules[name] = None`: `import name` then raises ImportError and
importlib.util.find_spec returns None, which is how diffusers, peft, transformers and accelerate
look for them, so the process runs as it would where they are not installed.
"""
from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from stages.train.quantization import LIBRARY

if TYPE_CHECKING:
    from stages.train.params import TrainParams

HIDDEN_ENV = "LORAPIPE_HIDDEN_LIBRARIES"
OPTIONAL = ("bitsandbytes", "torchao")


def unused(params: TrainParams) -> tuple[str, ...]:
    """The optional libraries a training with `params` never calls."""
    used = {LIBRARY.get(params.base_quantization), "bitsandbytes" if params.optimizer == "adamw8bit" else None}
    return tuple(name for name in OPTIONAL if name not in used)


def hiding(params: TrainParams) -> dict[str, str]:
    """The environment that makes a training process hide what `params` does not use."""
    return {HIDDEN_ENV: ",".join(unused(params))}


def hide_unused() -> None:
    """In a training process, before diffusers is imported: hide the libraries the stage named
    (one already imported stays)."""
    for name in filter(None, os.environ.get(HIDDEN_ENV, "").split(",")):
        sys.modules.setdefault(name, None)
