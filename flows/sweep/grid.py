"""A sweep's variants, from the config's `sweep:` section and the command line (`--grid key=v1,v2`
replaces or adds one key's values): each variant the base config with its overrides, validated as
an ordinary config, publishing into output_dir/variants/<name>/ under a pipeline name of its own
(its history in the cache: miss reasons, `cache gc --keep-last`). No Prefect here."""
from __future__ import annotations

import copy
import itertools
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from ..config import (ConfigError, PipelineConfig, SweepConfig, config_from, parse_override, read_config,
                      set_key)
from ..steps import pinned
from .keys import OPEN, closest_key, setting_type, typed
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
    """The `base` config, its `settings` (grid values typed), the `variants`, and the `shared`
    settings every variant trains with (--set key -> typed value, but sweep.* and output_dir; they
    name the variants' folders)."""

    base: PipelineConfig
    settings: SweepConfig
    variants: tuple[Variant, ...]
    shared: dict[str, Any]


def load_sweep(path: Path, overrides: list[str] = (), grid: list[str] = (), concurrency: int | None = None) -> Sweep:
    """The sweep of the config at `path` with `overrides` (--set), `grid` (--grid key=v1,v2) and
    `concurrency` (--concurrency) applied; a ConfigError, one line, for anything wrong."""
    path, source = Path(path), str(path)
    raw = read_config(path, overrides)
    base = config_from(copy.deepcopy(raw), path)
    written = parse_grid(grid, source)
    settings = base.sweep or SweepConfig()
    cli = {key: tuple(yaml.safe_load(text) for text in texts) for key, texts in written.items()}
    settings = settings.model_copy(update={"grid": {**settings.grid, **cli},
                                           **({"concurrency": concurrency} if concurrency is not None else {})})
    check_settings(settings, source)
    settings = typed_settings(settings, written, source)
    combos = override_sets(settings)
    if not combos:
        raise ConfigError(f"{path}: nothing to sweep: give a `sweep:` section with a grid or variants, or --grid"
                          " key=v1,v2")
    shared = shared_settings(overrides, source)
    variants = tuple(variant(raw, path, base, name, combo, shared)
                     for name, combo in zip(variant_names(combos), combos))
    check_metric(settings.metric, variants, source)
    return Sweep(base, settings, variants, shared)


def pinned_sweep(sweep: Sweep) -> Sweep:
    """`sweep` with its base's Hugging Face revision resolved once (flows/steps.py pinned), and each
    variant on the base's model pinned to the same commit: no variant trains on a moved branch."""
    base = pinned(sweep.base)
    variants = tuple(replace(v, config=v.config.model_copy(update={"model": base.model}))
                     if v.config.model == sweep.base.model else replace(v, config=pinned(v.config))
                     for v in sweep.variants)
    return replace(sweep, base=base, variants=variants)


def parse_grid(entries: list[str], source: str) -> dict[str, tuple[str, ...]]:
    """--grid key=v1,v2 entries as key -> its values as written."""
    grid = {}
    for entry in entries:
        key, sep, values = entry.partition("=")
        if not sep or not key or not values:
            raise ConfigError(f"{source}: --grid expects key=value1,value2, got {entry!r}")
        grid[key] = tuple(values.split(","))
    return grid


def check_settings(settings: SweepConfig, source: str) -> None:
    if settings.concurrency < 1:
        raise ConfigError(f"{source}: --concurrency must be 1 or more, got {settings.concurrency}")
    if settings.metric not in METRICS:
        raise ConfigError(f"{source}: sweep.metric: {settings.metric!r} is not one of {', '.join(METRICS)}")
    keys = [*settings.grid, *(key for overrides in settings.variants for key in overrides)]
    unknown = next((key for key in keys if setting_type(key) is None), None)
    if unknown:
        near = closest_key(unknown)
        raise ConfigError(f"{source}: sweep: {unknown} is not a config key" + (f"; did you mean {near}?" if near else
                                                                                 " (docs/config.md lists them)"))
    if settings.allow_data_keys:
        return
    data_key = next((key for key in keys if not key.startswith(SWEPT_SECTIONS)), None)
    if data_key:
        raise ConfigError(f"{source}: sweep: {data_key} is not a train. or evaluate. setting, so its variants would"
                          " each preprocess or encode again; set sweep.allow_data_keys: true to sweep it anyway")


def typed_settings(settings: SweepConfig, written: dict[str, tuple[str, ...]], source: str) -> SweepConfig:
    """The grid's and the variants' values as the types of the settings they set (--grid's 5e-4 a
    float, as 0.0005 is); two values of one key that are then equal are refused, naming both."""
    grid = {}
    for key, values in settings.grid.items():
        annotation, spelled = setting_type(key), written.get(key) or tuple(map(str, values))
        seen: list[tuple[Any, str]] = []
        for value, text in zip(values, spelled):
            value = typed(annotation, value)
            same = next((earlier for known, earlier in seen if known == value), None)
            if same is not None:
                raise ConfigError(f"{source}: sweep.grid {key}: {same} and {text} are the same value ({value});"
                                  " give it once")
            seen.append((value, text))
        grid[key] = tuple(value for value, _ in seen)
    variants = tuple({key: typed(setting_type(key), value) for key, value in overrides.items()}
                     for overrides in settings.variants)
    return settings.model_copy(update={"grid": grid, "variants": variants})


def check_metric(metric: str, variants: tuple[Variant, ...], source: str) -> None:
    """clip_score needs a CLIP model in every variant, or its variants train for a best never picked."""
    unscored = next((v for v in variants if v.config.evaluate.clip_model is None), None)
    if metric == "clip_score" and unscored:
        raise ConfigError(f"{source}: sweep.metric: clip_score needs evaluate.clip_model, which variant"
                          f" {unscored.name} leaves unset")


def shared_settings(overrides: list[str], source: str) -> dict[str, Any]:
    """The --set values every variant has, typed as their settings (not the sweep's own, nor
    output_dir: neither is in a variant's training)."""
    shared = {}
    for key, value in (parse_override(assignment, source) for assignment in overrides):
        if not key.startswith("sweep.") and key != "output_dir":
            shared[key] = typed(setting_type(key) or OPEN, value)
    return shared


def size_line(sweep: Sweep) -> str:
    """How many trainings the sweep means, and where they come from."""
    grid = " x ".join(str(len(values)) for values in sweep.settings.grid.values())
    made = [f"grid {grid}" if grid else "", f"{len(sweep.settings.variants)} listed" if sweep.settings.variants else ""]
    return (f"{len(sweep.variants)} variants ({', '.join(filter(None, made))}): as many trainings, each evaluated;"
            " a variant already trained is a cache hit")


def check_size(sweep: Sweep, confirmed: bool, source: str) -> None:
    """More variants than sweep.max_variants train only when `confirmed` (--yes)."""
    count, bound = len(sweep.variants), sweep.settings.max_variants
    if count > bound and not confirmed:
        raise ConfigError(f"{source}: the sweep has {count} variants, more than sweep.max_variants ({bound}): give"
                          " --yes to train them all, or --dry-run to list them")


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


def variant(raw: dict[str, Any], path: Path, base: PipelineConfig, name: str, overrides: dict[str, Any],
            shared: dict[str, Any]) -> Variant:
    """The base config (`raw`, as read) with `overrides`, publishing into its own folder (named by
    the `shared` --set values too: a sweep with others never overwrites it); a bad value is one line
    naming the variant and the key."""
    source = f"{path} (sweep variant {name})"
    mine = copy.deepcopy(raw)
    mine.pop("sweep", None)
    for key, value in overrides.items():
        set_key(mine, key, value, f"{source}: {key}")
    config = config_from(mine, path, source)
    folder = f"{name}+{label(shared, False)}" if shared else name
    pipeline_name = re.sub(r"[^\w.-]+", "-", f"{base.name}.{folder}")
    own = {"output_dir": base.output_dir / VARIANTS_DIR / folder, "name": pipeline_name}
    return Variant(name, dict(overrides), config.model_copy(update=own))
