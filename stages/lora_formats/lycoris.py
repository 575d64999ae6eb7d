"""DoRA, LoKr and LoHa in the LyCORIS keys ComfyUI reads, under the family's original module names
(ComfyUI's native spelling, as original_names.py writes a LoRA: `diffusion_model.<original>.<key>`).

peft names a LoKr's and a LoHa's tensors as LyCORIS does (`lokr_w1`, `lokr_w2_a`, `hada_w1_a`, ...)
and computes the same update: LoKr kron(w1, w2) and LoHa (w1_a w1_b) * (w2_a w2_b), each w = a b
when decomposed, times peft's scale. ComfyUI's loaders scale by `alpha / dim`, dim the rank of a
decomposed factor, a LoKr with no decomposed factor ignores alpha, and a file without `.alpha` is
applied at scale 1; so, as the LoRA export does, the scale is folded into the first factor and no
`.alpha` is written (diffusers' LoKr converters, which bake an `.alpha` in, then read it alike).
A DoRA is its LoRA (original_names.fused_lora) plus `.dora_scale`, one per output row, shaped
(rows, 1, ...) so that ComfyUI takes it as an output-axis magnitude; ComfyUI's rule for that axis
is W' = dora_scale * (W + dW) / ||W|| per row (the base weight's norm), so peft's magnitude m is
written as m ||W|| / ||W + dW|| (comfyui_magnitude), which gives the trained weight.

Modules that the original layout fuses (Flux's q/k/v in `qkv`, `linear1` = q|k|v|mlp): a LoHa fuses
like a LoRA, its two pairs each concatenated along the rank with the up factors block-diagonal (the
Hadamard product of two block-diagonal products keeps each part's rows); a DoRA fuses its LoRA so
and concatenates the magnitudes, taking a part without an adapter at its base row norms (so those
rows stay as they are); a Kronecker product cannot be split by rows, so a LoKr on a fused module is
written under the diffusers module's name where ComfyUI maps such names to their rows of the fused
weight (Flux.1's `transformer.<module>`: `slice_prefix`), and refused with the module's name
elsewhere. Why peft and not lycoris-lora, and how ComfyUI versions read
`dora_scale`: docs/adapters.md.
"""
from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from .original_names import COMFYUI, OriginalNames, fused_lora

if TYPE_CHECKING:
    import torch

FIRST_FACTOR = {"lokr": ("lokr_w1", "lokr_w1_a"), "loha": ("hada_w1_a",)}  # where the scale is folded
LOHA_PAIRS = (("hada_w1_a", "hada_w1_b"), ("hada_w2_a", "hada_w2_b"))  # (up, down) of each low-rank pair
DORA_MAGNITUDE = ".lora_magnitude_vector"  # peft's state-dict name of a DoRA's magnitude


def adapter_kind(config) -> str:
    """lora, dora, lokr or loha, from a peft config."""
    kind = str(getattr(config.peft_type, "value", config.peft_type)).lower()
    return "dora" if kind == "lora" and config.use_dora else kind


def adapted_modules(denoiser: torch.nn.Module) -> list[str]:
    """Names of the modules peft put an adapter on."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return sorted(name for name, m in denoiser.named_modules() if isinstance(m, BaseTunerLayer))


def lycoris_state_dict(denoiser: torch.nn.Module, names: OriginalNames,
                       slice_prefix: str | None = None) -> dict[str, torch.Tensor]:
    """The denoiser's DoRA, LoKr or LoHa in ComfyUI's native LyCORIS keys under `names` (a LoKr on a
    fused module under `slice_prefix` + its diffusers name, when the family's ComfyUI loader maps it)."""
    from .diffusers_format import ADAPTER, peft_state_dict

    kind = adapter_kind(denoiser.peft_config[ADAPTER])
    state = peft_state_dict(denoiser)
    scales = {name: denoiser.get_submodule(name).scaling[ADAPTER] for name in adapted_modules(denoiser)}
    if kind == "dora":
        return _dora(state, scales, names, lambda m: comfyui_magnitude(denoiser.get_submodule(m)))
    if kind == "loha":
        return _loha(state, scales, names)
    if kind == "lokr":
        return _lokr(state, scales, names, slice_prefix)
    raise ValueError(f"{kind}: a plain LoRA is written by original_names.fused_lora")


def check_writable(denoiser: torch.nn.Module, names: OriginalNames, slice_prefix: str | None = None) -> None:
    """Refuse, before training, an adapter the ComfyUI file could not hold (a LoKr on a module the
    original layout fuses, where ComfyUI has no name for its rows)."""
    from .diffusers_format import ADAPTER

    if adapter_kind(denoiser.peft_config[ADAPTER]) == "lokr":
        refuse_lokr_on_fused(set(adapted_modules(denoiser)), names, slice_prefix)


def refuse_lokr_on_fused(adapted: set[str], names: OriginalNames, slice_prefix: str | None) -> None:
    """A Kronecker product cannot be split by rows: a LoKr on part of a fused original module is
    written under `slice_prefix` + its diffusers name, or refused in one line naming the module."""
    if slice_prefix is not None:
        return
    for original, segments in names.items():
        part = next((s.module for s in segments if s.module in adapted), None)
        if part and _fused(segments):
            raise ValueError(f"train.target_modules: {part}: a LoKr cannot be written on {original}, which the"
                             " original layout fuses with other modules; leave it out of train.target_modules, or"
                             " train lora, dora or loha")


def _fused(segments: tuple) -> bool:
    """Whether an original module is more (or less) than one whole diffusers module."""
    whole = (Fraction(0), Fraction(1))
    return len(segments) > 1 or (segments[0].start, segments[0].end) != whole \
        or (segments[0].part_start, segments[0].part_end) != whole


def write_lycoris(denoiser: torch.nn.Module, names: OriginalNames, out_dir: Path, metadata: dict[str, str],
                  slice_prefix: str | None = None) -> Path | None:
    """The ComfyUI file of a DoRA, LoKr or LoHa (None for a plain LoRA: original_names.fused_lora)."""
    from .diffusers_format import ADAPTER, save_safetensors_sorted

    if adapter_kind(denoiser.peft_config[ADAPTER]) == "lora":
        return None
    path = Path(out_dir) / COMFYUI.file
    save_safetensors_sorted(lycoris_state_dict(denoiser, names, slice_prefix), metadata, path)
    return path


def _folded(state: dict, scales: dict[str, float], kind: str) -> dict[str, torch.Tensor]:
    """The state dict with each module's scale multiplied into its first factor."""
    out = dict(state)
    for module, scale in scales.items():
        key = next(f"{module}.{k}" for k in FIRST_FACTOR[kind] if f"{module}.{k}" in state)
        out[key] = state[key] * scale
    return out


def _lokr(state: dict, scales: dict[str, float], names: OriginalNames,
          slice_prefix: str | None) -> dict[str, torch.Tensor]:
    refuse_lokr_on_fused(set(scales), names, slice_prefix)
    folded, out = _folded(state, scales, "lokr"), {}
    for original, segments in names.items():
        adapted = [s for s in segments if s.module in scales]
        if not adapted:
            continue
        for s in adapted:
            name = f"{slice_prefix}{s.module}" if _fused(segments) else f"{COMFYUI.prefix}{original}"
            for key, value in folded.items():
                if key.startswith(f"{s.module}.") and key.count(".") == s.module.count(".") + 1:
                    out[f"{name}.{key.removeprefix(s.module + '.')}"] = value
    _check_placed(scales, names)
    return out


def _loha(state: dict, scales: dict[str, float], names: OriginalNames) -> dict[str, torch.Tensor]:
    """Each pair as a LoRA (down = w_b, up = w_a) through fused_lora, so fused modules fuse alike."""
    folded, out = _folded(state, scales, "loha"), {}
    for up, down in LOHA_PAIRS:
        as_lora = {}
        for module in scales:
            as_lora[f"{module}.lora_A.weight"] = folded[f"{module}.{down}"]
            as_lora[f"{module}.lora_B.weight"] = folded[f"{module}.{up}"]
        for key, value in fused_lora(as_lora, 1.0, names, COMFYUI).items():
            out[key.replace(f".{COMFYUI.down}", f".{down}").replace(f".{COMFYUI.up}", f".{up}")] = value
    return out


def _dora(state: dict, scales: dict[str, float], names: OriginalNames,
          magnitude_of: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
    import torch

    lora = {k: v for k, v in state.items() if not k.endswith(DORA_MAGNITUDE)}
    scale = _one_scale(scales)
    out = fused_lora(lora, scale, names, COMFYUI)
    for original, segments in names.items():
        if not any(s.module in scales for s in segments):
            continue
        up = out[f"{COMFYUI.prefix}{original}.{COMFYUI.up}"]
        rows = up.shape[0]
        magnitude = torch.empty(rows, dtype=up.dtype)
        for s in segments:
            whole = magnitude_of(s.module)
            n = whole.shape[0]
            magnitude[int(s.start * rows):int(s.end * rows)] = whole[int(s.part_start * n):int(s.part_end * n)]
        out[f"{COMFYUI.prefix}{original}.dora_scale"] = magnitude.reshape(rows, *[1] * (up.dim() - 1))
    return out


def _one_scale(scales: dict[str, float]) -> float:
    distinct = set(scales.values())
    if len(distinct) != 1:
        raise ValueError(f"the adapter's modules have different scales {sorted(distinct)}: not written")
    return distinct.pop()


def comfyui_magnitude(module: torch.nn.Module) -> torch.Tensor:
    """The `dora_scale` rows that make ComfyUI's output-axis DoRA give `module` its trained weight.
    peft trains W' = m (W + dW) / ||W + dW|| per row, but ComfyUI divides by the base weight's row
    norms ||W||, so m ||W|| / ||W + dW|| is written. A module without an adapter (part of a fused
    original module) gets ||W||: its rows stay as they are."""
    from peft.utils.integrations import dequantize_module_weight

    from .diffusers_format import ADAPTER

    base_layer = module.get_base_layer() if hasattr(module, "get_base_layer") else module
    base = dequantize_module_weight(base_layer).detach().float()  # a quantised base's too
    norms = _row_norms(base)
    if not hasattr(module, "lora_magnitude_vector"):
        return norms
    magnitude = module.lora_magnitude_vector[ADAPTER].weight.detach().float().reshape(-1)  # a conv's is (1, out, 1, 1)
    adapted = _row_norms(base + module.get_delta_weight(ADAPTER).detach().float())
    return magnitude * norms / adapted


def _row_norms(weight: torch.Tensor) -> torch.Tensor:
    return weight.reshape(weight.shape[0], -1).norm(dim=1)


def _check_placed(scales: dict[str, float], names: OriginalNames) -> None:
    placed = {s.module for segments in names.values() for s in segments}
    unplaced = sorted(set(scales) - placed)
    if unplaced:
        raise ValueError(f"no original module name for {unplaced[:3]}: this adapter cannot be written in the"
                         " original layout (train other target_modules, or use the diffusers file)")
