"""What a finished run exports: the family's files for the trained adapter, and with an EMA the same
files for the averaged adapter in `ema/`. A PiSSA/OLoRA adapter is exported in its plain-LoRA form
for the original base (adapter.plain_lora_swapped_in), from the initial adapter the run kept.
"""
from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

from lorapipe.stages.lora_formats.lora_folder import EMA_DIR
from lorapipe.stages.train.adapter import AdapterParams, plain_lora_swapped_in

if TYPE_CHECKING:
    import torch

    from lorapipe.stages.families import Family
    from lorapipe.stages.train.ema import AdapterEMA


def export_adapter(family: Family, denoiser: torch.nn.Module, out_dir: Path, provenance: dict[str, str],
                   kohya_metadata: dict[str, str], params: AdapterParams,
                   initial: dict[str, torch.Tensor] | None = None, ema: AdapterEMA | None = None) -> list[Path]:
    """Every exported file: the trained adapter's in out_dir, then the EMA's in out_dir/ema/."""
    if params.init != "default" and initial is None:
        raise ValueError(f"train.init {params.init}: the export needs the adapter's initial weights")
    written = _export(family, denoiser, Path(out_dir), provenance, kohya_metadata, params, initial)
    if ema is not None:
        with ema.swapped_in():
            (Path(out_dir) / EMA_DIR).mkdir(exist_ok=True)
            written += _export(family, denoiser, Path(out_dir) / EMA_DIR, {**provenance, "lorapipe.ema": "true"},
                               kohya_metadata, params, initial)
    return written


def _export(family: Family, denoiser: torch.nn.Module, out_dir: Path, provenance: dict[str, str],
            kohya_metadata: dict[str, str], params: AdapterParams, initial: dict | None) -> list[Path]:
    with ExitStack() as stack:
        if params.init != "default":
            stack.enter_context(plain_lora_swapped_in(denoiser, initial, params))
        return family.export_lora(denoiser, out_dir, provenance, kohya_metadata)
