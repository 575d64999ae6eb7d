"""The adapter a run trains (`train.adapter`, stages/train/adapter.py), with what its checkpoints keep
besides its weights: a PiSSA/OLoRA run's initial adapter, and the EMA (`train.ema_decay`).

A checkpoint directory holds `pytorch_lora_weights.safetensors` (the adapter as it loads on the
original base: for PiSSA/OLoRA its plain-LoRA form, so published checkpoints mean what they say),
and for PiSSA/OLoRA also `trained_adapter.safetensors` (the adapter as trained, which resume loads)
and `initial_adapter.safetensors` (its start: a resumed run subtracts it from the base weights
again instead of recomputing an SVD, and the export needs it); with an EMA, `ema.safetensors`.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from lorapipe.stages.families import Family
from lorapipe.stages.lora_formats.diffusers_format import (ADAPTER, load_diffusers_lora, peft_state_dict,
                                                           save_safetensors_sorted, write_diffusers_lora)
from lorapipe.stages.lora_formats.lora_folder import LORA_FILE
from lorapipe.stages.train.adapter import peft_config, plain_lora_swapped_in, restore_svd_init
from lorapipe.stages.train.ema import EMA_FILE, AdapterEMA
from lorapipe.stages.train.exports import export_adapter
from lorapipe.stages.train.params import TrainParams

INITIAL_FILE = "initial_adapter.safetensors"
TRAINED_FILE = "trained_adapter.safetensors"


class TrainedAdapter:
    def __init__(self, params: TrainParams, family: Family, targets: list[str]):
        self.params, self.family, self.prefix = params, family, family.components.adapter_prefix()
        self.config = peft_config(params, targets)
        self.initial: dict[str, torch.Tensor] | None = None
        self.ema: AdapterEMA | None = None

    def add_to(self, denoiser: torch.nn.Module, saved_start: dict[str, torch.Tensor] | None) -> None:
        """Give `denoiser` the adapter: as peft initialises it, or, resuming a PiSSA/OLoRA run, from
        its saved start (the checkpoint's own weights load later, with the optimizer's)."""
        if saved_start is None:
            denoiser.add_adapter(self.config)
            if self.params.init != "default":
                self.initial = {k: v.detach().clone() for k, v in peft_state_dict(denoiser).items()}
            return
        plain = self.params.model_copy(update={"init": "default"})  # no SVD: the saved start replaces it
        denoiser.add_adapter(peft_config(plain, self.config.target_modules))
        denoiser.peft_config[ADAPTER] = self.config
        self.initial = saved_start
        restore_svd_init(denoiser, self.initial)

    @staticmethod
    def saved_start(checkpoint: Path) -> dict[str, torch.Tensor]:
        """The PiSSA/OLoRA start a checkpoint keeps."""
        return load_file(checkpoint / INITIAL_FILE)

    def start_ema(self, denoiser: torch.nn.Module) -> None:
        """Average the adapter's weights from now on (after any init_lora), if train.ema_decay is set."""
        ema = self.params.ema
        self.ema = AdapterEMA(denoiser, ema) if ema else None

    def update_ema(self, step: int) -> None:
        if self.ema is not None:
            self.ema.update(step)

    def save(self, denoiser: torch.nn.Module, checkpoint: Path, provenance: dict[str, str]) -> None:
        if self.initial is None:
            write_diffusers_lora(denoiser, checkpoint / LORA_FILE, provenance, self.prefix)
        else:
            write_diffusers_lora(denoiser, checkpoint / TRAINED_FILE, provenance, self.prefix)
            save_safetensors_sorted(self.initial, {}, checkpoint / INITIAL_FILE)
            with plain_lora_swapped_in(denoiser, self.initial, self.params):
                write_diffusers_lora(denoiser, checkpoint / LORA_FILE, provenance, self.prefix)
        if self.ema is not None:
            self.ema.save(checkpoint / EMA_FILE)

    def load(self, denoiser: torch.nn.Module, checkpoint: Path) -> None:
        load_diffusers_lora(denoiser, checkpoint / (LORA_FILE if self.initial is None else TRAINED_FILE), self.prefix)
        if self.ema is not None:
            self.ema.load(checkpoint / EMA_FILE)

    def export(self, denoiser: torch.nn.Module, out_dir: Path, provenance: dict[str, str],
               kohya_metadata: dict[str, str]) -> list[Path]:
        """The family's files of the trained adapter, and of the EMA in out_dir/ema/."""
        return export_adapter(self.family, denoiser, out_dir, provenance, kohya_metadata, self.params, self.initial,
                              self.ema)
