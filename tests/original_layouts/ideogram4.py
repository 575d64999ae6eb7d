"""Ideogram 4's transformer as a single file: diffusers keeps no single-file converter for it, so
the file lorapipe accepts holds the diffusers names (with or without ComfyUI's prefix)."""
from __future__ import annotations

from .renaming import State


def transformer(state: State, config: dict) -> State:
    return dict(state)


WRITERS = {"Ideogram4Transformer2DModel": transformer}
