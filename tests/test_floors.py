"""The import graph keeps its floors (DESIGN.md, "Layout"): flows -> stages -> cache, and inside
stages the stage packages -> the models and their sources (models, encoded, sources/) -> the families
-> the LoRA file formats -> how jobs run (processes/) and the demo's data (demo/) -> the contracts;
and no production module is in an import cycle. Read from the source, every import (lazy and
TYPE_CHECKING ones too), so nothing is imported."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOPS = ("cache", "stages", "flows")  # bottom to top
STAGE_FLOORS = (  # inside stages, bottom to top; a module named nowhere is a contract (the ground)
    ("processes", "demo"), ("lora_formats",), ("families",), ("encoded", "models", "sources"), ("preprocess", "caption", "encode", "train", "evaluate"))


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of this repository it imports (not its own package's __init__, which
    Python runs before the module anyway)."""
    files = {module_name(p): p for top in TOPS for p in (REPO / top).rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets |= {base} | {f"{base}.{a.name}" for a in node.names}
        resolved = {_known(t.removeprefix("lorapipe."), files) for t in targets}
        graph[name] = {t for t in resolved if t and t != name and not name.startswith(t + ".")}
    return graph


def _known(name: str, files: dict) -> str | None:
    while name and name not in files:
        name = name.rpartition(".")[0]
    return name or None


def floor(module: str) -> tuple[int, int]:
    top, _, rest = module.partition(".")
    inside = next((i + 1 for i, names in enumerate(STAGE_FLOORS) if rest.split(".")[0] in names), 0)
    return TOPS.index(top), inside if top == "stages" else 0


def test_no_module_imports_one_on_a_higher_floor():
    upward = sorted((importer, imported) for importer, imports in import_graph().items() for imported in imports
                    if floor(imported) > floor(importer))
    assert upward == []


def test_no_production_module_is_in_an_import_cycle():
    graph = import_graph()

    def reaches(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    assert sorted(m for m in graph if m in reaches(m)) == []
