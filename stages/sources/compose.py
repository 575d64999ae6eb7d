"""A model made of component files over a base: the components the config sets (model.transformer,
model.vae, model.text_encoders, ...) checked against the base's family, and the diffusers folder
every stage then loads, composed once under the cache's models/<digest>/: the base's
model_index.json (a modular one's entries pointed at the composed folder), each component the
config leaves alone a link to the base's folder (no copy), a component folder given a link to it,
a single file converted into a component folder (stages/sources/convert.py). The folder is made in
a staging folder and renamed into place, so concurrent runs are safe; the user's files are never changed. Keys never read this folder: each
component is keyed by its own content (stages/models.py), so a new VAE re-encodes latents only.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Mapping, Sequence

from lorapipe.cache.digest import digest_json
from lorapipe.cache.errors import UserError
from lorapipe.cache.fsutil import publish_folder
from lorapipe.stages.contract import Log
from lorapipe.stages.families import Family
from lorapipe.stages.families.folders import SINGLE_FILE_SUFFIX, component_names, copy_index, found_index

from .convert import convert_component

TEXT_ENCODERS = "model.text_encoders"


def components_over(family: Family, base: Path, given: Mapping[str, Path],
                    text_encoders: Mapping[str, Path] | Sequence[Path] | None) -> dict[str, Path]:
    """The components set over the diffusers folder `base` of `family` (bound to it), by their
    model_index.json names: `given` (model.<name>: denoisers and the VAE) and model.text_encoders,
    by name or in the family's order. Refuses in one line, naming the key, a component the model has
    none of and a path that is neither a weights file nor a component folder."""
    encoders = text_encoder_names(family, base)
    settable = (*family.components.denoisers(), *family.components.latent)
    for name in given:
        if name not in settable:
            offered = ", ".join([*(f"model.{n}" for n in settable), f"{TEXT_ENCODERS} ({', '.join(encoders)})"])
            raise UserError(f"model.{name}: a {family.label} model has no {name}; what can be set over its base:"
                            f" {offered}")
    chosen = {**given, **_named_encoders(text_encoders or {}, encoders)}
    for name, path in chosen.items():
        _check_component(f"{TEXT_ENCODERS}.{name}" if name in encoders else f"model.{name}", Path(path))
    return {name: Path(path) for name, path in chosen.items()}


def text_encoder_names(family: Family, base: Path) -> tuple[str, ...]:
    """The family's text encoders in `base`, in its order: its text components that are models (a
    config.json), not tokenizers or processors."""
    return tuple(name for name in family.components.text if (Path(base) / name / "config.json").is_file())


def _named_encoders(given: Mapping[str, Path] | Sequence[Path], encoders: tuple[str, ...]) -> dict[str, Path]:
    expected = ", ".join(encoders)
    if isinstance(given, Mapping):
        unknown = next((name for name in given if name not in encoders), None)
        if unknown is not None:
            raise UserError(f"{TEXT_ENCODERS}: the model has no text encoder {unknown!r}; its text encoders: {expected}")
        return dict(given)
    if len(given) != len(encoders):
        raise UserError(f"{TEXT_ENCODERS}: {len(given)} given but the model has {len(encoders)} text encoders:"
                        f" {expected} (a list is taken in that order)")
    return dict(zip(encoders, given))


def _check_component(key: str, path: Path) -> None:
    if (path.is_file() and path.suffix == SINGLE_FILE_SUFFIX) or (path / "config.json").is_file():
        return
    raise UserError(f"{key}: {path} is neither a {SINGLE_FILE_SUFFIX} file nor a diffusers component folder"
                    " (config.json and weights)")


def composed_folder(family: Family, base: Path, components: Mapping[str, Path], digests: Mapping[str, str],
                    models_root: Path, log: Log) -> Path:
    """`models_root/<digest>/`: the diffusers folder of `base` with `components` set over it (made
    once: a folder already there is reused). `digests`: every component's content digest, which,
    with the paths the folder links to, names it."""
    linked = {name: str(path) for name, path in components.items() if path.is_dir()}
    target = Path(models_root) / digest_json({"base": str(base), "digests": dict(digests), "linked": linked})
    if found_index(target) is not None:
        return target
    staging = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        for name in component_names(base):
            given = components.get(name)
            if given is not None and given.is_file():
                _convert(family, name, given, base, staging / name, log)
            else:
                (staging / name).symlink_to((given or Path(base) / name).absolute(), target_is_directory=True)
        copy_index(Path(base), staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    publish_folder(staging, target)
    return target


def _convert(family: Family, name: str, file: Path, base: Path, target: Path, log: Log) -> None:
    log(f"model: converting {file} into the {name} of a diffusers folder (once; kept in the cache)")
    convert_component(family, name, file, base, target, log)
