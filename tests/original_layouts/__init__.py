"""The exactness harness for component files in original layouts: a tiny model folder's component,
written as a family's original layout (each family group's module has its writers), converted by
stages/sources/convert.py over the folder, must give every tensor of the folder's own, bit for bit
and in its dtype; and, where diffusers' `from_single_file` reads the file at tiny size, diffusers
must load the same weights (an independent check of the writer).

    original = to_original(tensor_map, folder_tensors(model, "transformer"))  # or a writer of its own
    converted = convert_written(family, "transformer", model, original, tmp_path, COMFYUI_PREFIX)
    assert_same_tensors(converted, folder_tensors(model, "transformer"))
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lorapipe.stages.families import Family
from lorapipe.stages.lora_formats.original_names import TensorMap
from lorapipe.stages.sources.convert import convert_component

COMFYUI_PREFIX = "model.diffusion_model."


def folder_tensors(folder: Path, component: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a diffusers component folder (`folder/component`), shards merged."""
    return {k: v for f in sorted((folder / component).glob("*.safetensors")) for k, v in load_file(f).items()}


def write_file(tensors: dict[str, torch.Tensor], path: Path, prefix: str = "") -> Path:
    save_file({prefix + k: v.contiguous() for k, v in tensors.items()}, path)
    return path


def to_original(tensor_map: TensorMap, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Diffusers-named `tensors` in the original names, by inverting a row map derived from
    diffusers' converter (original_names.derive_tensor_map): each original tensor its rows, in order."""
    pieces: dict[str, list] = {}
    for key, segments in tensor_map.items():
        rows = tensors[key].shape[0]
        for s in segments:
            piece = tensors[key][int(s.part_start * rows):int(s.part_end * rows)]
            pieces.setdefault(s.module, []).append((s.start, piece))
    return {name: torch.cat([piece for _, piece in sorted(parts, key=lambda p: p[0])])
            for name, parts in pieces.items()}


def convert_written(family: Family, component: str, model: Path, tensors: dict[str, torch.Tensor], tmp_path: Path,
                    prefix: str = "") -> dict[str, torch.Tensor]:
    """`tensors` written as one file under `prefix`, converted over `model`: the converted tensors."""
    name = f"{component}{prefix.replace('.', '_')}"
    file = write_file(tensors, tmp_path / f"{name}.safetensors", prefix)
    target = tmp_path / name
    convert_component(family, component, file, model, target, log=print)
    return folder_tensors(target)


def assert_same_tensors(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    """The same names, and each tensor equal in dtype, shape and every value."""
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype, name
        assert ours[name].shape == tensor.shape, name
        assert torch.equal(ours[name], tensor), f"{name}: max abs difference {(ours[name] - tensor).abs().max()}"


def assert_diffusers_reads_the_same(cls: type, file: Path, model: Path, component: str) -> None:
    """diffusers' own from_single_file, with the folder's config, loads the folder's weights."""
    loaded = cls.from_single_file(str(file), config=str(model), subfolder=component, torch_dtype=torch.float32)
    assert_same_tensors({k: v.contiguous() for k, v in loaded.state_dict().items()}, folder_tensors(model, component))
