"""An exponential moving average of the adapter's weights, kept beside training.

Every `every` optimiser steps: ema <- decay * ema + (1 - decay) * weight, in float32, for the
trainable (adapter) parameters only, on the CPU (no accelerator memory; a copy per update) or on
the weights' device. Checkpoints save it (`save`/`load`: a safetensors file whose metadata holds
the update count and settings, so a resumed run continues the same average), and the export writes
the average as its own files by swapping it into the model for the duration (`swapped_in`).
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Literal

from pydantic import Field, model_validator

from lorapipe.stages.contract import Frozen

if TYPE_CHECKING:
    import torch

EMA_FILE = "ema.safetensors"


class EMAParams(Frozen):
    """Keyed: the EMA weights are part of the result (the device too: CPU and accelerator arithmetic
    can differ in the last bit)."""

    # out of the dump at their defaults (no EMA), so runs keyed before the EMA existed keep their keys
    ema_decay: float | None = Field(None, gt=0, lt=1, exclude_if=lambda v: v is None,
                                    description="keep an EMA of the adapter weights with this"
                                    " decay per update (e.g. 0.999) and export it as its own files in ema/;"
                                    " null: no EMA")
    ema_every: int = Field(1, gt=0, exclude_if=lambda v: v == 1, description="update the EMA every N optimiser steps")
    ema_device: Literal["cpu", "device"] = Field("cpu", exclude_if=lambda v: v == "cpu",
                                                 description="where the EMA lives: cpu (no accelerator"
                                                 " memory) or the training device (no copy per update)")

    @model_validator(mode="after")
    def _needs_decay(self) -> "EMAParams":
        for key in ("ema_every", "ema_device"):
            if self.ema_decay is None and getattr(self, key) != EMAParams.model_fields[key].default:
                raise ValueError(f"train.{key} applies with train.ema_decay: set ema_decay, or remove {key}")
        return self


class AdapterEMA:
    def __init__(self, model: torch.nn.Module, params: EMAParams):
        if params.ema_decay is None:
            raise ValueError("AdapterEMA needs train.ema_decay")
        self.params, self.updates = params, 0
        self.weights = {name: p for name, p in model.named_parameters() if p.requires_grad}
        if not self.weights:
            raise ValueError("the model has no trainable parameters to average")
        self.average = {name: self._copy(p) for name, p in self.weights.items()}

    def _copy(self, p: torch.Tensor) -> torch.Tensor:
        import torch

        device = "cpu" if self.params.ema_device == "cpu" else p.device
        return p.detach().to(device=device, dtype=torch.float32, copy=True)

    def update(self, step: int) -> bool:
        """After optimiser step `step` (1-based): average in the weights if the step is an update step."""
        import torch

        if step % self.params.ema_every:
            return False
        with torch.no_grad():
            for name, p in self.weights.items():
                average = self.average[name]
                average.lerp_(p.detach().to(device=average.device, dtype=torch.float32), 1 - self.params.ema_decay)
        self.updates += 1
        return True

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The model holds the average (in its own dtype) inside the block, its trained weights after."""
        import torch

        trained = {name: p.detach().clone() for name, p in self.weights.items()}
        try:
            with torch.no_grad():
                for name, p in self.weights.items():
                    p.copy_(self.average[name])
            yield
        finally:
            with torch.no_grad():
                for name, p in self.weights.items():
                    p.copy_(trained[name])

    def save(self, path: Path) -> None:
        from lorapipe.stages.lora_formats.diffusers_format import save_safetensors_sorted

        metadata = {"updates": str(self.updates), **{k: str(v) for k, v in self.params.model_dump().items()}}
        save_safetensors_sorted(self.average, metadata, Path(path))

    def load(self, path: Path) -> None:
        """Continue the average saved in `path` (a checkpoint of this run: same settings and weights)."""
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            metadata, saved = f.metadata() or {}, {k: f.get_tensor(k) for k in f.keys()}
        settings = {k: str(v) for k, v in self.params.model_dump().items()}
        differing = sorted(k for k, v in settings.items() if metadata.get(k) != v)
        shapes = {k: tuple(v.shape) for k, v in self.average.items()}
        if differing or {k: tuple(v.shape) for k, v in saved.items()} != shapes:
            what = f"its {', '.join(differing)} differ" if differing else "its weights are not this adapter's"
            raise ValueError(f"{path}: cannot continue this EMA ({what}); remove the checkpoint or train with"
                             " the settings that wrote it")
        for name, value in saved.items():
            self.average[name].copy_(value)
        self.updates = int(metadata["updates"])
