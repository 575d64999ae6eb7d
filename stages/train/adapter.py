"""The adapter a run trains (`train.adapter`): LoRA, DoRA, LoKr or LoHa, built with peft's own
configs (LoraConfig, with use_dora for DoRA; LoKrConfig; LoHaConfig), plus rsLoRA scaling and
PiSSA/OLoRA initialisation, which peft's LoraConfig offers. Imports nothing heavy at module
level: flows build train keys from AdapterParams.

Every adapter starts as a no-op on the base model except PiSSA and OLoRA: they move the top of the
base weights' spectrum (PiSSA: SVD; OLoRA: QR) into the adapter and subtract it from the frozen
base. A file of the trained adapter alone would then apply to a base nobody else has, so the
export turns it into a plain LoRA on the original base (`as_plain_lora`: rank 2r, peft's
subtract_mutated_init rule), which needs the adapter's initial weights: `plain_lora_swapped_in`
shows the model so to the family's export.

Why peft and not lycoris-lora, and what each type exports to: docs/adapters.md.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, Literal

from pydantic import Field, model_validator

from lorapipe.cache.errors import UserError
from lorapipe.stages.contract import Frozen

if TYPE_CHECKING:
    from pathlib import Path

    import torch
    from peft import PeftConfig

AdapterKind = Literal["lora", "dora", "lokr", "loha"]
LORA_KINDS = ("lora", "dora")  # peft's LoraConfig: rsLoRA, dropout and the SVD/QR initialisations apply


class AdapterParams(Frozen):
    """The adapter's type, size and initialisation: all change the trained weights (keyed)."""

    # each setting added after runs were keyed stays out of the dump at its default (exclude_if), so a
    # plain LoRA keeps the train key and train_config.json it had
    adapter: AdapterKind = Field("lora", exclude_if=lambda v: v == "lora",
                                 description="lora, dora (LoRA with a learned per-row magnitude), lokr (Kronecker"
                                 " product) or loha (Hadamard product of two low-rank pairs)")
    rank: int = Field(4, gt=0, description="the rank of the adapter's low-rank factors (for lokr and loha, of"
                      " each factor peft decomposes)")
    alpha: float = Field(4.0, gt=0, description="the update is scaled by alpha / rank (alpha / sqrt(rank) with"
                         " rslora)")
    dropout: float = Field(0.0, ge=0, lt=1, description="lora/dora: dropout on the adapter's input")
    rslora: bool = Field(False, exclude_if=lambda v: not v,
                         description="lora/dora: rank-stabilised scaling alpha / sqrt(rank)")
    init: Literal["default", "pissa", "olora"] = Field(
        "default", exclude_if=lambda v: v == "default", description="lora: start from the base weights' principal"
        " components (pissa: SVD; olora: QR) instead of a zero update; default: a zero update (LoRA/DoRA's down"
        " weights gaussian)")
    lokr_factor: int = Field(-1, exclude_if=lambda v: v == -1,
                             description="lokr: the Kronecker factor's size; -1 makes the factors as square as possible")

    @model_validator(mode="after")
    def _applies(self) -> "AdapterParams":
        applies = {"dropout": LORA_KINDS, "rslora": LORA_KINDS, "init": ("lora",), "lokr_factor": ("lokr",)}
        changed = {"dropout": self.dropout != 0, "rslora": self.rslora, "init": self.init != "default",
                   "lokr_factor": self.lokr_factor != -1}
        for key, kinds in applies.items():
            if changed[key] and self.adapter not in kinds:
                raise ValueError(f"train.{key} applies to adapter {' and '.join(kinds)}, not {self.adapter}:"
                                 " remove it")
        if self.lokr_factor == 0 or self.lokr_factor < -1:
            raise ValueError(f"train.lokr_factor: a positive factor, or -1; not {self.lokr_factor}")
        return self

    @property
    def scale(self) -> float:
        """What the adapter's raw product is multiplied by (peft's `scaling`)."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def peft_config(params: AdapterParams, target_modules: list[str]) -> PeftConfig:
    """peft's config for `params` on `target_modules` (as the family resolved them)."""
    from peft import LoHaConfig, LoKrConfig, LoraConfig

    targets = list(target_modules)
    if params.adapter in LORA_KINDS:
        return LoraConfig(r=params.rank, lora_alpha=params.alpha, lora_dropout=params.dropout,
                          use_dora=params.adapter == "dora", use_rslora=params.rslora, target_modules=targets,
                          init_lora_weights="gaussian" if params.init == "default" else params.init)
    if params.adapter == "lokr":
        return LoKrConfig(r=params.rank, alpha=params.alpha, decompose_factor=params.lokr_factor,
                          target_modules=targets)
    return LoHaConfig(r=params.rank, alpha=params.alpha, target_modules=targets)


def adaptable_types(kind: AdapterKind) -> tuple[type[torch.nn.Module], ...]:
    """The module types peft can put an adapter of this kind on."""
    import torch

    if kind in LORA_KINDS:  # peft's LoRA and DoRA layers (peft.tuners.lora)
        return torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d
    from peft import LoHaModel, LoKrModel

    return tuple({"lokr": LoKrModel, "loha": LoHaModel}[kind].layers_mapping)


def check_targets(denoiser: torch.nn.Module, kind: AdapterKind, targets: list[str]) -> None:
    """Refuse, in one line naming train.target_modules and the module, a target the adapter cannot
    wrap (a container such as a ModuleList), where peft would stop with a TypeError of its own.
    `denoiser` may be its empty structure (folders.empty_component): only module types are read."""
    supported = adaptable_types(kind)
    for name, module in denoiser.named_modules():
        entry = next((t for t in targets if name == t or name.endswith(f".{t}")), None)  # peft's rule for names
        if entry is None or isinstance(module, supported):
            continue
        inside = next((sub for sub, m in module.named_modules() if sub and isinstance(m, supported)), None)
        hint = f"name a layer inside it, such as {entry}.{inside}" if inside else "leave it out"
        raise UserError(f"train.target_modules: {entry}: {name} is a {type(module).__name__}, which a {kind} cannot"
                        f" adapt (only {', '.join(t.__name__ for t in supported)}): {hint}")


def load_init_lora(denoiser: torch.nn.Module, path: Path, params: AdapterParams, prefix: str) -> None:
    """Start from an existing diffusers-format adapter file (its adapter must have this run's type,
    rank, alpha and target layers: a different alpha would load it at the wrong strength)."""
    from lorapipe.stages.lora_formats.diffusers_format import adapter_kind, load_diffusers_lora, recorded_adapter

    if not path.is_file():
        raise FileNotFoundError(f"train.init_lora: {path} is not a file")
    if params.init != "default":
        raise ValueError(f"train.init_lora: a {params.init} adapter starts from the base weights' principal"
                         f" components, not from {path}: set train.init: default, or leave init_lora out")
    recorded = recorded_adapter(path, prefix)
    if adapter_kind(recorded) != params.adapter:
        raise ValueError(f"train.init_lora: {path} holds a {adapter_kind(recorded)} adapter but train.adapter is"
                         f" {params.adapter}")
    for key, value in (("rank", recorded.get("r")), ("alpha", recorded.get("lora_alpha", recorded.get("alpha")))):
        if value is not None and float(value) != float(getattr(params, key)):
            raise ValueError(f"train.init_lora: {path} has {key} {value} but train.{key} is {getattr(params, key)}")
    load_diffusers_lora(denoiser, path, prefix)


def as_plain_lora(trained: dict[str, torch.Tensor], initial: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A PiSSA/OLoRA adapter (peft state dict) as a LoRA on the original base: W + s(BA - B0A0) =
    W + s[B | -B0][A ; A0], rank 2r at the same scale s (so alpha doubles, or grows by sqrt 2 with
    rslora: `plain_lora_alpha`)."""
    import torch

    plain = {}
    for key, value in trained.items():
        if key.endswith(".lora_A.weight"):
            plain[key] = torch.cat([value, initial[key]], dim=0)
        elif key.endswith(".lora_B.weight"):
            plain[key] = torch.cat([value, -initial[key]], dim=1)
        else:
            raise ValueError(f"{key}: only a plain LoRA's weights can be converted from PiSSA/OLoRA")
    return plain


def plain_lora_alpha(params: AdapterParams) -> float:
    """The alpha that keeps `params.scale` at rank 2r."""
    rank = 2 * params.rank
    return params.scale * (math.sqrt(rank) if params.rslora else rank)


def kohya_network_dim_alpha(params: AdapterParams) -> tuple[int, float]:
    """kohya's `ss_network_dim` and `ss_network_alpha` for the exported files: the rank they hold (2r:
    PiSSA/OLoRA export as a plain LoRA of rank 2r) and the alpha whose alpha / dim, the scale kohya's
    loaders apply (they know no rsLoRA), is the trained scale."""
    dim = params.rank if params.init == "default" else 2 * params.rank
    return dim, params.scale * dim


def restore_svd_init(denoiser: torch.nn.Module, initial: dict[str, torch.Tensor]) -> None:
    """Put a PiSSA/OLoRA start back on a denoiser given a LoRA of the same config with the default
    init: each adapted base weight loses scale * B0 A0, computed as peft's init computes it, and the
    adapter holds `initial` (a resumed run; the saved start, not a new SVD, whose result may differ
    between devices)."""
    import torch
    from peft.utils import transpose

    from lorapipe.stages.lora_formats.diffusers_format import ADAPTER
    from lorapipe.stages.lora_formats.lycoris import adapted_modules

    with torch.no_grad():
        for name in adapted_modules(denoiser):
            layer = denoiser.get_submodule(name)
            down, up = initial[f"{name}.lora_A.weight"], initial[f"{name}.lora_B.weight"]
            base = layer.get_base_layer()
            weight = transpose(base.weight.to(torch.float32), layer.fan_in_fan_out)
            weight = weight.data - layer.scaling[ADAPTER] * up.to(weight.device) @ down.to(weight.device)
            base.weight.data = transpose(weight.to(base.weight.dtype), layer.fan_in_fan_out)
            layer.lora_A[ADAPTER].weight.data = down.to(layer.lora_A[ADAPTER].weight, copy=True)  # trained in place
            layer.lora_B[ADAPTER].weight.data = up.to(layer.lora_B[ADAPTER].weight, copy=True)


@contextmanager
def plain_lora_swapped_in(denoiser: torch.nn.Module, initial: dict[str, torch.Tensor],
                          params: AdapterParams) -> Iterator[None]:
    """Inside the block the denoiser's adapter is the plain-LoRA form of its PiSSA/OLoRA adapter
    (rank 2r, `plain_lora_alpha`, for the original base), as the exports read it (its state dict
    and peft config); the trained adapter is back after. The frozen base weights are not touched:
    exports do not read them."""
    import dataclasses

    import torch

    from lorapipe.stages.lora_formats.diffusers_format import ADAPTER, peft_state_dict
    from lorapipe.stages.lora_formats.lycoris import adapted_modules

    plain = as_plain_lora(peft_state_dict(denoiser), initial)
    config, trained = denoiser.peft_config[ADAPTER], []
    for name in adapted_modules(denoiser):
        layer = denoiser.get_submodule(name)
        trained.append((layer, layer.lora_A[ADAPTER], layer.lora_B[ADAPTER], layer.r[ADAPTER]))
        for part in ("lora_A", "lora_B"):
            weight = plain[f"{name}.{part}.weight"]
            linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device,
                                     dtype=weight.dtype)
            linear.weight = torch.nn.Parameter(weight, requires_grad=False)
            getattr(layer, part)[ADAPTER] = linear
        layer.r[ADAPTER] = 2 * params.rank
    denoiser.peft_config[ADAPTER] = dataclasses.replace(config, r=2 * params.rank, lora_alpha=plain_lora_alpha(params),
                                                        init_lora_weights=True)
    try:
        yield
    finally:
        denoiser.peft_config[ADAPTER] = config
        for layer, down, up, rank in trained:
            layer.lora_A[ADAPTER], layer.lora_B[ADAPTER], layer.r[ADAPTER] = down, up, rank
