"""What a base model is made of, per component, read without loading it (`lorapipe model`): where
its files came from, its class, its weights' dtype and parameter count (from the safetensors
headers), and the digest the stage keys use for it."""
from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from lorapipe.stages.families.folders import is_component, is_single_file, model_index, tensor_headers

from .model_source import BaseModel, Source

if TYPE_CHECKING:
    from lorapipe.stages.families import Family

SHARD_INDEX = "*.safetensors.index.json"  # a sharded component's map of tensors to files
TORCH_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}  # of the safetensors dtypes


@dataclass(frozen=True)
class Component:
    name: str  # as model_index.json names it
    source: Source
    digest: str
    class_name: str | None = None  # library.Class, as model_index.json names it (None: not known unconverted)
    dtype: str | None = None  # the weights' dtype, by parameter count ("BF16+F32" when mixed); None: no weights
    parameters: int = 0

    def to_json(self) -> dict:
        return {**vars(self), "source": self.source.to_json()}


def components(folder: Path | None, digests: dict[str, str], source: Source,
               over: Mapping[str, Path]) -> list[Component]:
    """A row per component the digests name, read from the diffusers `folder` (None: a single file
    not converted yet, known by its digests only) or, for those set over it, from their own files."""
    if folder is None:
        return [Component(name, source, digest) for name, digest in sorted(digests.items())]
    index = model_index(folder)
    return [Component(name, component_source(over[name]) if name in over else source, digest,
                      ".".join(index[name]) if is_component(index.get(name)) else None,
                      *weights_summary(over.get(name, folder / name))) for name, digest in sorted(digests.items())]


def component_source(path: Path) -> Source:
    """Where a component set over the base came from: its single file or its folder."""
    return Source("single file" if is_single_file(path) else "folder", str(path))


def weights_summary(folder: Path) -> tuple[str | None, int]:
    """(the dtype of most of a component folder's parameters, with the others after a +; how many
    there are), from its safetensors files' headers: the shards its index names, else every file."""
    counts: Counter[str] = Counter()
    for file in weight_files(folder):
        for entry in tensor_headers(file).values():
            counts[entry["dtype"]] += math.prod(entry["shape"])
    return ("+".join(dtype for dtype, _ in counts.most_common()) or None), sum(counts.values())


def stored_dtype(folder: Path) -> str | None:
    """The torch dtype most of a component's parameters are stored in (None: none of float32, bfloat16,
    float16, e.g. an fp8 file)."""
    dtype = weights_summary(folder)[0]
    return TORCH_DTYPES.get(dtype.split("+")[0]) if dtype else None


def weight_files(folder: Path) -> list[Path]:
    if folder.is_file():  # a component's one file
        return [folder]
    index = next(iter(sorted(folder.glob(SHARD_INDEX))), None)
    if index is None:
        return sorted(folder.glob("*.safetensors"))
    return [folder / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]


@dataclass(frozen=True)
class ModelReport:
    family: str
    label: str
    variant: str | None  # None: a single file not converted yet
    source: Source
    components: list[Component]

    def to_json(self) -> dict:
        return {**vars(self), "source": self.source.to_json(), "components": [c.to_json() for c in self.components]}


def describe(base: BaseModel, family: Family, digests: dict[str, str], converted: Path,
             over: Mapping[str, Path] | None = None) -> ModelReport:
    """The model `base` of `family`, its components keyed by `digests`; a single file read from
    `converted`, its diffusers folder in the cache, once a run has made it; `over`: the components
    set over the base (stages/sources/compose.py), read from their own files."""
    folder = base.path
    if is_single_file(folder):
        folder = converted if (converted / "model_index.json").is_file() else None
    bound = family.for_model(folder) if folder else family
    return ModelReport(bound.name, bound.label, bound.variant.name if bound.variant else None, base.source,
                       components(folder, digests, base.source, over or {}))
