"""Original (non-diffusers) module names, derived from diffusers' own single-file converters, and
the LoRA export in those names with fused projections (kohya's `lora_unet_*` for Flux.1).

diffusers keeps, for each family, a converter from the original checkpoint layout to its own
(`convert_<family>_transformer_checkpoint_to_diffusers`). Feeding it a probe checkpoint whose every
tensor is a column of row tags (the tensor's index times ROWS plus the row number) and reading the
tags back out of the converted tensors says, for every diffusers weight, which original tensor and
which of its rows it came from: `to_q`, `to_k`, `to_v` are the thirds of `img_attn.qkv`; `linear1`
is `to_q | to_k | to_v | proj_mlp`; `norm_out.linear` is `final_layer.adaLN_modulation.1` with its
halves swapped. So no name table is written here by hand; what is hand-written is what the
converter needs to see (`seed_keys`: one tensor per block so it counts the blocks, as the family
module says) and `ROWS`, a row count its hard-coded splits accept.

A LoRA on diffusers modules that share one original module becomes one LoRA on it: the downs
concatenated along the rank (rank = the sum), the ups placed block-diagonally in the original
rows (zeros where a part has no LoRA), so that each part keeps its trained scale. diffusers' kohya
converter splits such a fused file back (its "sparse" up-weight path), which is how the tests check
the export.

Spellings of the same fused LoRA (`KeySpelling`): kohya's (`lora_unet_<name with _>.lora_down.weight`,
`.lora_up.weight`, `.alpha` = scale x rank; weights as trained) and ComfyUI's native one, as
ai-toolkit and musubi-tuner write for the 2026 families (`diffusion_model.<name>.lora_A.weight`,
`.lora_B.weight`), with the scale folded into the up weight and no `.alpha`: ComfyUI then applies
scale 1, and diffusers' converters for that layout refuse `.alpha` keys they do not expect (Flux.2)
or read none. Flux.1's ComfyUI file spells the weights `lora_down`/`lora_up`, the only spelling of
`diffusion_model.*` files diffusers' Flux.1 loader converts (`COMFYUI_DOWN_UP`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction
from typing import TYPE_CHECKING, Callable, Iterable

if TYPE_CHECKING:
    import torch

ROWS = 21504  # Flux.1's single-block linear1: 3 x 3072 + 12288 rows (the converter splits it so)


@dataclass(frozen=True)
class Segment:
    """Rows [start, end) of an original weight are rows [part_start, part_end) of a diffusers
    module's weight; all as fractions of the respective weight's rows."""

    module: str  # diffusers module name
    start: Fraction
    end: Fraction
    part_start: Fraction
    part_end: Fraction


OriginalNames = dict[str, tuple[Segment, ...]]  # original module -> its rows, in order


def whole(module: str) -> Segment:
    """All of a diffusers module's rows, as all of an original module's."""
    return Segment(module, Fraction(0), Fraction(1), Fraction(0), Fraction(1))

TensorMap = dict[str, tuple[Segment, ...]]  # diffusers tensor -> the original tensors' rows it is made of, in order


class _Probe(dict):
    """A checkpoint that makes up every tensor the converter asks for: row tags of its own."""

    def __init__(self, seed_keys: list[str]):
        super().__init__()
        self.names: list[str] = []
        for key in seed_keys:
            self[key] = self._make(key)

    def _make(self, key: str) -> torch.Tensor:
        import torch

        self.names.append(key)
        return torch.arange(ROWS, dtype=torch.int32) + (len(self.names) - 1) * ROWS

    def __missing__(self, key: str) -> torch.Tensor:
        self[key] = self._make(key)
        return self[key]

    def pop(self, key: str, *default) -> torch.Tensor:
        if key not in self:
            self[key] = self._make(key)
        return super().pop(key)


def weight_keys(blocks: Iterable[str], block_modules: Iterable[str], top_modules: Iterable[str] = ()) -> list[str]:
    """The original checkpoint's weight names of `block_modules` in each block, then of `top_modules`:
    the seed keys derive_original_names runs a converter on."""
    return [f"{block}.{module}.weight" for block in blocks for module in block_modules] + \
        [f"{module}.weight" for module in top_modules]


def derive_tensor_map(convert: Callable[[dict], dict], seed_keys: list[str]) -> TensorMap:
    """Which original tensors' rows each diffusers tensor (weight, bias, norm) is made of, by
    running `convert` on a probe: a map that converts a checkpoint of any size (apply_tensor_map)."""
    probe = _Probe(seed_keys)
    converted = convert(probe)
    found: TensorMap = {}
    for key, tags in converted.items():
        if tags.ndim != 1:
            continue
        source, row = (tags // ROWS).tolist(), (tags % ROWS).tolist()
        segments, start = [], 0
        for i in range(1, len(tags) + 1):  # runs of consecutive rows of one source
            if i == len(tags) or source[i] != source[start] or row[i] != row[i - 1] + 1:
                segments.append(Segment(probe.names[source[start]], Fraction(row[start], ROWS),
                                        Fraction(row[i - 1] + 1, ROWS), Fraction(start, len(tags)),
                                        Fraction(i, len(tags))))
                start = i
        found[key] = tuple(segments)
    return found


def derive_original_names(convert: Callable[[dict], dict], seed_keys: list[str]) -> OriginalNames:
    """Which original weights' rows each diffusers weight is made of, by running `convert`."""
    return names_of(derive_tensor_map(convert, seed_keys))


def names_of(tensor_map: TensorMap) -> OriginalNames:
    """A tensor map's weights as original modules, each with the diffusers modules' rows it holds."""
    found: dict[str, list[Segment]] = {}
    for key, segments in tensor_map.items():
        for s in segments if key.endswith(".weight") else ():
            if s.module.endswith(".weight"):
                found.setdefault(s.module.removesuffix(".weight"), []).append(
                    replace(s, module=key.removesuffix(".weight")))
    return {name: tuple(sorted(segments, key=lambda s: s.start)) for name, segments in found.items()}


def apply_tensor_map(tensor_map: TensorMap, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An original checkpoint's `tensors` in diffusers' names, at whatever size they are; KeyError
    for a tensor it lacks, ValueError for one left over or whose rows do not split as the map does."""
    import torch

    out, used = {}, set()
    for key, segments in tensor_map.items():
        parts = []
        for s in segments:
            source = tensors[s.module]
            start, end = s.start * source.shape[0], s.end * source.shape[0]
            if start.denominator != 1 or end.denominator != 1:
                raise ValueError(f"{s.module}: its {source.shape[0]} rows do not split as {key} takes them")
            parts.append(source[int(start):int(end)])
            used.add(s.module)
        out[key] = parts[0] if len(parts) == 1 else torch.cat(parts)
    left = sorted(set(tensors) - used)
    if left:
        raise ValueError(f"{left[0]} is not a tensor of this model ({len(left)} left over)")
    return out


@dataclass(frozen=True)
class KeySpelling:
    """How an exported file names an original module's LoRA tensors."""

    file: str  # the exported file's name
    prefix: str  # before the module name; `lora_unet_` also turns the name's dots into `_`
    down: str
    up: str
    alpha: bool  # `.alpha` = scale x rank with the weights as trained; else the scale is in the up weight

    def keys(self, original: str) -> tuple[str, str, str]:
        """(down, up, alpha) tensor names of an original module's LoRA."""
        name = kohya_name(original) if self.prefix == KOHYA_PREFIX else f"{self.prefix}{original}"
        return f"{name}.{self.down}", f"{name}.{self.up}", f"{name}.alpha"


KOHYA_PREFIX = "lora_unet_"
KOHYA = KeySpelling("pytorch_lora_weights_kohya.safetensors", KOHYA_PREFIX, "lora_down.weight", "lora_up.weight",
                    alpha=True)
COMFYUI = KeySpelling("pytorch_lora_weights_comfyui.safetensors", "diffusion_model.", "lora_A.weight",
                      "lora_B.weight", alpha=False)
COMFYUI_DOWN_UP = replace(COMFYUI, down=KOHYA.down, up=KOHYA.up)


def kohya_name(original: str) -> str:
    return KOHYA_PREFIX + original.replace(".", "_")


def own_names(model: torch.nn.Module) -> OriginalNames:
    """Each Linear of the model (adapted or not) under its own (diffusers) name, whole: for a model
    whose original layout is diffusers' own."""
    import torch
    from peft.tuners.tuners_utils import BaseTunerLayer

    modules = dict(model.named_modules())
    adapted = {name for name, module in modules.items() if isinstance(module, BaseTunerLayer)}
    linear = {name for name, module in modules.items() if isinstance(module, torch.nn.Linear)
              and not any(name.startswith(f"{a}.") for a in adapted)}  # an adapter's own layers and its base
    return {name: (whole(name),) for name in sorted(adapted | linear)}


def by_diffusers_module(names: OriginalNames) -> OriginalNames:
    """The same modules each under its own (diffusers) name, whole: for a loader that maps diffusers
    names onto their rows of the original weights itself (ComfyUI's Z-Image key map)."""
    return {s.module: (whole(s.module),) for segments in names.values() for s in segments}


def fused_lora(lora: dict[str, torch.Tensor], scale: float, names: OriginalNames,
               spelling: KeySpelling = KOHYA) -> dict[str, torch.Tensor]:
    """The LoRA in original names, spelt as `spelling`, for a peft state dict (`<module>.lora_A.weight`,
    `.lora_B.weight`) trained at alpha/r = scale."""
    import torch

    downs = {k.removesuffix(".lora_A.weight"): v for k, v in lora.items() if k.endswith(".lora_A.weight")}
    ups = {k.removesuffix(".lora_B.weight"): v for k, v in lora.items() if k.endswith(".lora_B.weight")}
    out, placed = {}, set()
    for original, segments in names.items():
        parts = list(dict.fromkeys(s.module for s in segments if s.module in downs))
        if not parts:
            continue
        columns, rank = {}, 0
        for part in parts:
            columns[part] = slice(rank, rank + downs[part].shape[0])
            rank += downs[part].shape[0]
        rows = _original_rows(segments, ups)
        up = torch.zeros(rows, rank, *ups[parts[0]].shape[2:], dtype=ups[parts[0]].dtype)  # a conv's (1, 1) too
        for s in segments:
            if s.module in ups:
                n = ups[s.module].shape[0]
                up[int(s.start * rows):int(s.end * rows), columns[s.module]] = \
                    ups[s.module][int(s.part_start * n):int(s.part_end * n)]
        down_key, up_key, alpha_key = spelling.keys(original)
        out[down_key] = torch.cat([downs[part] for part in parts])
        out[up_key] = up if spelling.alpha else up * scale
        if spelling.alpha:
            out[alpha_key] = torch.tensor(float(scale * rank))
        placed.update(parts)
    unplaced = sorted(set(downs) - placed)
    if unplaced:
        raise ValueError(f"no original module name for {unplaced[:3]}: this LoRA cannot be written in the"
                         " original layout (train other target_modules, or use the diffusers file)")
    return out


def _original_rows(segments: tuple[Segment, ...], ups: dict[str, torch.Tensor]) -> int:
    """The original weight's row count, from a segment whose diffusers module has a LoRA."""
    s = next(s for s in segments if s.module in ups)
    rows = ups[s.module].shape[0] * (s.part_end - s.part_start) / (s.end - s.start)
    if rows.denominator != 1:
        raise ValueError(f"{s.module}: {ups[s.module].shape[0]} rows do not divide as the converter splits them")
    return int(rows)
