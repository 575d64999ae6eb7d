"""What every stage shares: frozen params models and the run signature's types.

A stage module exposes VERSION, OUTPUT_FILES (the files of its artifact a run publishes for the
user), a `Params` model (exactly the settings that change its output), optionally an `Options`
model (settings that do not: batch sizes, worker counts), an inputs dataclass, and
`run(params, inputs, out_dir, work_dir, options, log) -> Built | None`. A stage that decides which
files the dataset keeps also names FINDINGS_FILE: its artifact's JSON of rejected and warning rows
(`path`, `reason`, `detail`), every earlier stage's included, which the published report lists.
"""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from functools import cache
from importlib.metadata import version
from pathlib import Path
from typing import Annotated, Callable, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, PlainSerializer, PlainValidator

from lorapipe.cache.objects import is_url, local_path

Log = Callable[[str], None]
KEYED_LIBRARIES = ("torch", "diffusers", "transformers")  # their major versions are in every stage's key


def _path_or_url(value: object) -> object:
    if isinstance(value, str):
        return value.rstrip("/") if is_url(value) else local_path(value)
    return value


# a local path, or an object-storage URL (`s3://bucket/prefix`, kept as a string); file:// is a path
PathOrUrl = Annotated[Union[Path, str], BeforeValidator(_path_or_url)]


def location_name(location: Path | str) -> str:
    """The last component of a path or URL (a folder's name)."""
    return Path(location).name if isinstance(location, Path) else location.rstrip("/").rsplit("/", 1)[-1]


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def json_form(cls: type) -> object:
    """`cls`, a class with to_json and from_json (a stage's inputs), as the type of a Frozen model's
    field: validated from its JSON form and serialised as it."""
    return Annotated[cls, PlainValidator(lambda value: value if isinstance(value, cls) else cls.from_json(value)),
                     PlainSerializer(lambda value: value.to_json())]


@dataclass(frozen=True)
class OutputFile:
    """A file of a stage's artifact that a run publishes into its output folder, beside the run's
    summary (flows/outputs.py)."""

    path: str  # inside the artifact; a run publishes those its stage wrote
    label: str = ""  # what `lorapipe run` calls it when it names where the file went; "": not named
    folder: bool = False  # `path` is a folder of the stage's: every file under it is published


class JsonInputs:
    """For a stage's inputs dataclass of paths, strings and dicts: the JSON form a worker process
    reads its inputs from (the job file), and back; the fields annotated Path become Paths again."""

    def to_json(self) -> dict:
        return {f.name: value if isinstance(value := getattr(self, f.name), dict) else str(value)
                for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, value: dict):
        paths = {f.name: Path(value[f.name]) for f in dataclasses.fields(cls) if f.type in ("Path", Path)}
        return cls(**{**value, **paths})


def library_majors(*names: str) -> dict[str, str]:
    """Major versions of the libraries that compute an output (keyed: a minor upgrade keeps caches)."""
    return {name: _version(name).split(".")[0] for name in names}


def library_versions(*names: str) -> dict[str, str]:
    """Exact versions, recorded in manifests for provenance but never keyed."""
    return {name: _version(name) for name in names}


@cache
def _version(name: str) -> str:  # record keys ask per sample; reading package metadata is not free
    return version(name)


def derived_seed(*parts: object) -> int:
    """A 63-bit seed from `parts` (their str joined by ':'): the same in every process, on every
    machine and Python (never Python's salted hash)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
