"""The config's dotted keys as a sweep names them (train.rank): whether a key exists, the closest
one to a typo, and a swept value read as the type of the setting it sets (so that 0.0005 and 5e-4
are one value), all from the frozen config models. No Prefect here."""
from __future__ import annotations

import difflib
import functools
import types
import typing
from typing import Any

from pydantic import TypeAdapter, ValidationError

from ..config_docs import settings

OPEN = object()  # the annotation below a mapping setting: any key, any value
SCALARS = (bool, int, float, str, type(None))  # what a typed value may become (a folder name, JSON)


def setting_type(dotted: str) -> Any | None:
    """The annotation of the setting `dotted` names (OPEN inside a mapping setting); None when no
    setting has that name."""
    known = _settings()
    if dotted in known:
        return known[dotted]
    parents = (dotted.rsplit(".", depth)[0] for depth in range(1, dotted.count(".") + 1))
    return OPEN if any(parent in known and _is_mapping(known[parent]) for parent in parents) else None


def closest_key(dotted: str) -> str | None:
    """The known key most like `dotted` (a typo's intended key), or None when none is close."""
    found = difflib.get_close_matches(dotted, list(_settings()), n=1, cutoff=0.6)
    return found[0] if found else None


def typed(annotation: Any, value: Any) -> Any:
    """`value` as the setting's type where that makes a scalar ("5e-4" -> 0.0005 for a float, 8.0
    -> 8 for an integer; but 8 stays 8 for a float, its variant's name unchanged), else as given (a
    wrong one is the variant's config error, naming the key)."""
    if annotation is OPEN:
        return value
    try:
        converted = TypeAdapter(annotation).validate_python(value)
    except ValidationError:
        return value
    widened = type(value) is int and type(converted) is float
    return converted if type(converted) in SCALARS and not widened else value


@functools.cache
def _settings() -> dict[str, Any]:
    """Every dotted key --set takes -> its annotation (docs/config.md's rows, but a list's entries)."""
    return {s.key: s.field.annotation for s in settings() if "[]" not in s.key}


def _is_mapping(annotation: Any) -> bool:
    return any(typing.get_origin(a) is dict or a is dict or a is Any for a in _options(annotation))


def _options(annotation: Any) -> tuple[Any, ...]:
    """The members of a union (`X | None`), else the annotation alone."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    return typing.get_args(annotation) if union else (annotation,)
