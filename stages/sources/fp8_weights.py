"""fp8 component files (fp8_e4m3fn, and ComfyUI's scaled fp8) dequantised once, at conversion.

ComfyUI's scaled fp8 stores a Linear's weight as fp8 with a `<layer>.scale_weight` beside it
(maybe a `<layer>.scale_input`, and a `scaled_fp8` marker tensor) and computes with
`weight.to(dtype) * scale_weight.to(dtype)` in its compute dtype; a plain fp8 file has no scales.
The converted folder holds the weights so dequantised, in the precision the file keeps its other
tensors (bfloat16 where it keeps none): every stage loads it as any folder, and
`train.base_quantization: fp8` stores the frozen base in fp8 again while training. The upcast
costs memory and disk against the file, and the log says how much, once.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from lorapipe.stages.contract import Log

if TYPE_CHECKING:
    import torch

SCALE, INPUT_SCALE, MARKER = ".scale_weight", ".scale_input", "scaled_fp8"  # ComfyUI's names


def dequantised(tensors: dict[str, torch.Tensor], file: Path, log: Log) -> dict[str, torch.Tensor]:
    """`tensors` with every fp8 weight in full precision (times its scale, as ComfyUI applies it)
    and ComfyUI's scale and marker tensors dropped; unchanged when none is fp8."""
    import torch

    fp8 = {name for name, t in tensors.items() if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)} - {MARKER}
    if not fp8:
        return tensors
    dtype = _kept_precision(tensors, fp8)
    out = {}
    for name, t in tensors.items():
        if name == MARKER or name.endswith((SCALE, INPUT_SCALE)):
            continue
        if name not in fp8:
            out[name] = t
            continue
        scale = tensors.get(name.removesuffix(".weight") + SCALE)  # none in a plain fp8 file
        out[name] = t.to(dtype) if scale is None else t.to(dtype) * scale.to(dtype)
    before = sum(tensors[name].nbytes for name in fp8)
    after = sum(out[name].nbytes for name in fp8 if name in out)
    log(f"{file}: {len(fp8)} fp8 tensors dequantised to {str(dtype).removeprefix('torch.')} for training:"
        f" {before:,} bytes in the file, {after:,} in memory and in the converted folder"
        f" (train.base_quantization: fp8 stores the frozen base in fp8 again)")
    return out


def _kept_precision(tensors: dict[str, torch.Tensor], fp8: set[str]) -> torch.dtype:
    """The float type of the file's other floating tensors (its biases and norms), or bfloat16."""
    import torch

    kept = {t.dtype for name, t in tensors.items() if name not in fp8 and name != MARKER and t.is_floating_point()
            and not name.endswith((SCALE, INPUT_SCALE))}
    return kept.pop() if len(kept) == 1 else torch.bfloat16
