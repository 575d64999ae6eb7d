"""docs/config.md, written from the config models: every key with its type, default, whether it is
keyed, and its `Field(description=...)`.

    python -m lorapipe.flows.config_docs docs/config.md    # rewrite the page (no argument: print it)

tests/test_docs.py fails when a setting has no description or the page is not current.
"""
from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Iterator, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from lorapipe.flows.config import COMPONENT_KEYS, PipelineConfig
from lorapipe.stages.caption import CaptionParams
from lorapipe.stages.encode import EncodeParams
from lorapipe.stages.evaluate import LOCAL_PATHS, EvalParams
from lorapipe.stages.preprocess import PreprocessParams
from lorapipe.stages.train import TrainParams

# the model whose fields are a stage's keyed params; the rest of the section are its options
KEYED_PARAMS: dict[str, type[BaseModel]] = {"preprocess": PreprocessParams, "caption": CaptionParams,
                                            "encode": EncodeParams, "train": TrainParams, "evaluate": EvalParams}
KEYED_BY_PREPROCESS = "data.datasets[]"  # every dataset setting is in preprocess's key (caption's: caption's)
# keyed by the content digest of what they point at, never by the path
BY_CONTENT = {"model.path", *(f"model.{name}" for name in COMPONENT_KEYS), "model.text_encoders", "caption.model",
              "data.path", "data.datasets[].path", "train.init_lora", *(f"evaluate.{name}" for name in LOCAL_PATHS)}

HEADER = """# Config reference

Generated from the config models by `python -m lorapipe.flows.config_docs docs/config.md`: to change
a text here, change the setting's `Field(description=...)` and regenerate. A config is YAML with one
section per stage; relative paths resolve against the config file's folder; `--set key=value` overrides
one key; a bad value stops the command before anything runs, in one line naming the key. Presets:
`configs/`.

**Keyed**: `yes`: part of the stage's cache key, so changing it reruns that stage and those after it
([caching](caching.md)); `content`: the key holds the content digest of the file or folder, never its
path; `no`: changes how or where the work runs, not its result.
"""


@dataclass(frozen=True)
class Setting:
    key: str  # dotted, as --set takes it; `[]` marks the entries of a list
    field: FieldInfo
    section: str  # the key of the section that holds it ("" for the top level)
    holds: str | None = None  # for a section (a model, or a list of them): the key its settings are under


def settings(model: type[BaseModel] = PipelineConfig, prefix: str = "") -> Iterator[Setting]:
    """Every field of `model` and of the models inside it, in declaration order, depth first."""
    for name, field in model.model_fields.items():
        key = prefix + name
        inner = _model_in(field.annotation)
        holds = None if inner is None else f"{key}[]" if get_origin(field.annotation) is tuple else key
        yield Setting(key, field, prefix.rstrip("."), holds)
        if inner is not None:
            yield from settings(inner, f"{holds}.")


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for arg in get_args(annotation) if (m := _model_in(arg)) is not None), None)


def keyed(key: str) -> str:
    if key in BY_CONTENT:
        return "content"
    stage, _, rest = key.partition(".")
    if stage in KEYED_PARAMS:
        return "yes" if rest.split(".")[0] in KEYED_PARAMS[stage].model_fields else "no"
    return "yes" if key.startswith(KEYED_BY_PREPROCESS + ".") else "no"


def type_name(annotation: Any, limits: str = "") -> str:
    """`annotation` for people; `limits` (the field's constraints) go with the type they bound."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return type_name(args[0], limits)
    if origin in (Union, types.UnionType):
        kinds = [a for a in args if a is not type(None)]
        named = "path or URL" if set(kinds) == {Path, str} else " or ".join(type_name(a) for a in kinds)
        named += f" ({limits})" if limits else ""
        return f"{named}, or null" if type(None) in args else named
    if origin is Literal:
        named = ", ".join(f"`{v}`" for v in args)
    elif origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        named = f"list of {type_name(args[0])}"
    elif origin is tuple:
        named = "[" + ", ".join(type_name(a) for a in args) + "]"
    else:
        names = {str: "text", int: "integer", float: "number", bool: "boolean", Path: "path", dict: "mapping"}
        named = names.get(origin or annotation, str(annotation))
    return f"{named} ({limits})" if limits else named


def constraints(field: FieldInfo) -> str:
    words = {"gt": "> {}", "ge": "≥ {}", "lt": "< {}", "le": "≤ {}", "multiple_of": "multiple of {}",
             "min_length": "at least {}"}
    return ", ".join(word.format(getattr(item, name)) for item in field.metadata
                     for name, word in words.items() if isinstance(getattr(item, name, None), (int, float)))


def default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        return f"`{json.dumps(field.default_factory())}`" if field.default_factory in (dict, list, tuple) \
            else "see description"
    if field.default is PydanticUndefined:
        return "required"
    value = field.default
    shown = value if isinstance(value, str) else json.dumps(value)
    return f"`{shown}`" if shown != "" else '`""`'


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    intros: dict[str, str] = {}
    rows: dict[str, list[tuple[str, str]]] = {}  # section -> (keyed, row)
    for s in settings():
        if s.holds:
            intros[s.holds] = s.field.description or ""
            continue
        label = next((m for m in s.field.metadata if isinstance(m, str)), None)  # a type named for people
        kind, how = label or type_name(s.field.annotation, constraints(s.field)), keyed(s.key)
        rows.setdefault(s.section, []).append((how, f"| `{s.key}` | {_cell(kind)} | {default(s.field)} | {how}"
                                               f" | {_cell(s.field.description or '')} |"))
    out = [HEADER]
    for section, lines in rows.items():
        out.append(f"## `{section}`\n" if section else "## Top level\n")
        if intros.get(section):
            out.append(intros[section] + "\n")
        keyed_first = [row for _, row in sorted(lines, key=lambda line: line[0] == "no")]
        out += ["| key | type | default | keyed | description |", "|---|---|---|---|---|", *keyed_first, ""]
    return "\n".join(out)


def main(argv: list[str]) -> None:
    page = render()
    if argv:
        Path(argv[0]).write_text(page)
    else:
        sys.stdout.write(page)


if __name__ == "__main__":
    main(sys.argv[1:])
