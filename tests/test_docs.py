"""The documentation stays true to the code: every config key has a description, and docs/config.md
is what the generator writes from the models today."""
from __future__ import annotations

from pathlib import Path

from lorapipe.flows.config_docs import render, settings

REPO = Path(__file__).resolve().parent.parent


def test_every_config_key_has_a_description():
    missing = [s.key for s in settings() if not (s.field.description or "").strip()]
    assert not missing, f"give these settings a Field(description=...): {missing}"


def test_docs_config_md_is_current():
    page = REPO / "docs" / "config.md"
    assert page.read_text() == render(), \
        "docs/config.md is stale: run `python -m lorapipe.flows.config_docs docs/config.md`"
