"""Checks every family test makes the same way: a tiny build is byte-identical, a denoiser call is
captured from the pipeline's first step, and a LoRA file means what was trained (loaded through
diffusers' own loaders into a fresh pipeline, fused, and its weight change compared with the
in-memory model's)."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

import lorapipe.stages.families as families
from lorapipe.stages.families import ObjectiveParams
from lorapipe.stages.lora_formats.lycoris import adapted_modules
from lorapipe.stages.lora_formats.original_names import kohya_name


def assert_builds_byte_identically(model: Path, arch: str, again: Path) -> list[str]:
    families.build_tiny_model(again, arch)
    files = sorted(str(p.relative_to(model)) for p in model.rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(again)) for p in again.rglob("*") if p.is_file())
    for rel in files:
        assert (model / rel).read_bytes() == (again / rel).read_bytes(), rel
    return files


def quiet_pipeline(model: Path):
    """The model's diffusers pipeline (the class its model_index.json names), without progress bars."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def first_call(module: torch.nn.Module, run) -> tuple[tuple, dict, object]:
    """The args, kwargs and output of the first call of `module` while `run()` runs."""
    seen = []

    def hook(_, args, kwargs, output):
        if not seen:
            seen.append((args, kwargs, output))

    handle = module.register_forward_hook(hook, with_kwargs=True)
    try:
        run()
    finally:
        handle.remove()
    return seen[0]


def assert_shift_is_the_schedulers(model: Path, mu_of: Callable[[int], float]):
    """The objective's shifted sigmas are the scheduler's, at `mu_of(image tokens)` (64 x 48 px and
    1024 x 1024 px at 16 px a token); returns the objective."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    objective = families.for_model(model).objective(model, ObjectiveParams())
    u = torch.tensor([0.9, 0.5, 0.1])
    for tokens in (12, 4096):
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(model, subfolder="scheduler")
        scheduler.set_timesteps(sigmas=u.tolist(), mu=mu_of(tokens))
        assert torch.allclose(objective.shifted(u, tokens), scheduler.sigmas[:-1])
    return objective


def trained_lora(family, model: Path, targets: str | tuple[str, ...], alpha: float = 3.0, rank: int = 4):
    """The tiny denoiser with a LoRA whose up weights are not zero (as after training)."""
    from peft import LoraConfig

    denoiser = family.load_denoiser(model, torch.float32)
    if isinstance(targets, str):
        targets = family.lora_target_modules(denoiser, targets)
    denoiser.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                                    init_lora_weights="gaussian"))
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in denoiser.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return denoiser, list(targets)


def fused_change(pipe, denoiser: str, lora: Path | dict, **load_kwargs) -> dict[str, torch.Tensor]:
    """Each Linear's weight change after load_lora_weights (with `load_kwargs`) + fuse_lora of
    `denoiser` in `pipe` (fresh)."""
    model = getattr(pipe, denoiser)
    base = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    if isinstance(lora, Path):
        pipe.load_lora_weights(lora.parent, weight_name=lora.name, **load_kwargs)
    else:
        pipe.load_lora_weights(lora, **load_kwargs)
    pipe.fuse_lora(components=[denoiser])
    return {n: m.weight.detach() - base[n] for n, m in model.named_modules() if n in base}


def assert_means_what_was_trained(denoiser, targets: list[str], change: dict[str, torch.Tensor]) -> None:
    """Every trained module changed by its B @ A x scale, every other Linear not at all."""
    for name, delta in change.items():
        trained = denoiser.get_submodule(name).get_delta_weight("default") if name in targets else 0 * delta
        assert torch.allclose(delta, trained, atol=1e-6), name


def respelled_as_kohya(file: Path, out: Path) -> Path:
    """The same tensors under kohya's spelling of the same original names (`diffusion_model.a.b.lora_A
    .weight` -> `lora_unet_a_b.lora_down.weight`): ComfyUI's key map registers both spellings for
    every weight, and some diffusers converters read only this one."""
    spelling = {".lora_A.weight": ".lora_down.weight", ".lora_B.weight": ".lora_up.weight", ".alpha": ".alpha",
                ".dora_scale": ".dora_scale"}
    renamed = {}
    for key, value in load_file(file).items():
        suffix = next(s for s in spelling if key.endswith(s))
        renamed[kohya_name(key.removeprefix("diffusion_model.").removesuffix(suffix)) + spelling[suffix]] = value
    save_file(renamed, out)
    return out


def merged(denoiser) -> torch.nn.Module:
    """A copy of the denoiser with peft's own merge of its adapter into every adapted weight."""
    copied = copy.deepcopy(denoiser)
    for name in adapted_modules(copied):
        copied.get_submodule(name).merge()
    return copied


def weight(denoiser, module: str) -> torch.Tensor:
    """A module's (base) weight, whether or not it carries an adapter."""
    layer = denoiser.get_submodule(module)
    return getattr(layer, "base_layer", layer).weight.detach()
