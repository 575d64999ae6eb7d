"""A sweep's variants, from the config's `sweep:` section and the command line (`--grid key=v1,v2`
replaces or adds one key's values): each variant the base config with its overrides, validated as
an ordinary config, publishing into output_dir/variants/<name>/ under a pipeline name of its own
(its history in the cache: miss reasons, `cache gc --keep-last`). No Prefect here."""
from __future__ import annotations

import copy
import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..config import ConfigError, PipelineConfig, SweepConfig, config_from, read_config, set_key
from .report import METRICS

VARIANTS_DIR = "variants"
SWEPT_SECTIONS = ("train.", "evaluate.")  # what varies over one encode


@dataclass(frozen=True)
class Variant:
    """One training of the sweep: its folder-safe `name`, the `overrides` that make it (dotted key
    -> value, as given) and its `config` (the base's with them, its own output_dir and name)."""

    name: str
    overrides: dict[str, Any]
    config: PipelineConfig

    @property
    def changes_data(self) -> bool:
        """Whether it sets a key outside train. and evaluate. (sweep.allow_data_keys): its stages
        before train are its own then, not the sweep's shared ones."""
        return any(not key.startswith(SWEPT_SECTIONS) for key in self.overrides)


@dataclass(frozen=True)
class Sweep:
    base: PipelineConfig
    settings: SweepConfig
    variants: tuple[Variant, ...]


def load_sweep(path: Path, overrides: list[str] = (), grid: list[str] = (), concurrency: int | None = None) -> Sweep:
    """The sweep of the config at `path` with `overrides` (--set), `grid` (--grid key=v1,v2) and
    `concurrency` (--concurrency) applied; a ConfigError, one line, for anything wrong."""
    path = Path(path)
    raw = read_config(path, overrides)
    base = config_from(copy.deepcopy(raw), path)
    settings = base.sweep or SweepConfig()
    settings = settings.model_copy(update={"grid": {**settings.grid, **parse_grid(grid, str(path))},
                                           **({"concurrency": concurrency} if concurrency is not None else {})})
    check_settings(settings, str(path))
    combos = override_sets(settings)
    if not combos:
        raise ConfigError(f"{path}: nothing to sweep: give a `sweep:` section with a grid or variants, or --grid"
                          " key=v1,v2")
    variants = tuple(variant(raw, path, base, name, combo) for name, combo in zip(variant_names(combos), combos))
    return Sweep(base, settings, variants)


def parse_grid(entries: list[str], source: str) -> dict[str, tuple[Any, ...]]:
    """--grid key=v1,v2 entries as key -> values, each value read as a YAML scalar (as --set reads one)."""
    grid = {}
    for entry in entries:
        key, sep, values = entry.partition("=")
        if not sep or not key or not values:
            raise ConfigError(f"{source}: --grid expects key=value1,value2, got {entry!r}")
        grid[key] = tuple(yaml.safe_load(value) for value in values.split(","))
    return grid


def check_settings(settings: SweepConfig, source: str) -> None:
    if settings.concurrency < 1:
        raise ConfigError(f"{source}: --concurrency must be 1 or more, got {settings.concurrency}")
    if settings.metric not in METRICS:
        raise ConfigError(f"{source}: sweep.metric: {settings.metric!r} is not one of {', '.join(METRICS)}")
    if settings.allow_data_keys:
        return
    keys = [*settings.grid, *(key for overrides in settings.variants for key in overrides)]
    data_key = next((key for key in keys if not key.startswith(SWEPT_SECTIONS)), None)
    if data_key:
        raise ConfigError(f"{source}: sweep: {data_key} is not a train. or evaluate. setting, so its variants would"
                          " each preprocess or encode again; set sweep.allow_data_keys: true to sweep it anyway")


def override_sets(settings: SweepConfig) -> list[dict[str, Any]]:
    """The grid's combinations (in its key order), then the explicit variants; each once."""
    keys = list(settings.grid)
    combos = [dict(zip(keys, values)) for values in itertools.product(*settings.grid.values())] if keys else []
    unique: list[dict[str, Any]] = []
    for overrides in [*combos, *settings.variants]:
        if overrides not in unique:
            unique.append(dict(overrides))
    return unique


def variant_names(combos: list[dict[str, Any]]) -> list[str]:
    """"k=v,k=v" of each key's last segment, folder-safe; the whole dotted keys where two keys share
    their last segment."""
    keys = {key for overrides in combos for key in overrides}
    short = len({key.rpartition(".")[2] for key in keys}) == len(keys)
    return [label(overrides, short) for overrides in combos]


def label(overrides: dict[str, Any], short: bool) -> str:
    text = ",".join(f"{key.rpartition('.')[2] if short else key}={value}" for key, value in overrides.items())
    return re.sub(r"[^\w.,=+-]+", "-", text).strip(".") or "base"


def variant(raw: dict[str, Any], path: Path, base: PipelineConfig, name: str, overrides: dict[str, Any]) -> Variant:
    """The base config (`raw`, as read) with `overrides`, publishing into its own folder; a bad
    value is one line naming the variant and the key."""
    source = f"{path} (sweep variant {name})"
    mine = copy.deepcopy(raw)
    mine.pop("sweep", None)
    for key, value in overrides.items():
        set_key(mine, key, value, f"{source}: {key}")
    config = config_from(mine, path, source)
    pipeline_name = re.sub(r"[^\w.-]+", "-", f"{base.name}.{name}")
    own = {"output_dir": base.output_dir / VARIANTS_DIR / name, "name": pipeline_name}
    return Variant(name, dict(overrides), config.model_copy(update=own))
