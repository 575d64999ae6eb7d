"""The documentation stays true to the code: every config key has a description, docs/config.md is
what the generator writes from the models today, docs/adding-a-family.md's family table what it
writes from the registry, and every relative link in README.md and docs/ points at a file (and
heading) that exists."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from lorapipe.flows.config_docs import render, settings
from lorapipe.flows.family_docs import with_table

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_every_config_key_has_a_description():
    missing = [s.key for s in settings() if not (s.field.description or "").strip()]
    assert not missing, f"give these settings a Field(description=...): {missing}"


def test_docs_config_md_is_current():
    page = REPO / "docs" / "config.md"
    assert page.read_text() == render(), \
        "docs/config.md is stale: run `python -m lorapipe.flows.config_docs docs/config.md`"


def test_docs_family_table_is_current():
    page = (REPO / "docs" / "adding-a-family.md").read_text()
    assert page == with_table(page), "docs/adding-a-family.md's family table is stale: run" \
        " `python -m lorapipe.flows.family_docs docs/adding-a-family.md`"


def unfenced(text: str) -> str:
    """The Markdown without fenced code blocks (whose `#` lines are not headings)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def prose(text: str) -> str:
    """The Markdown without code blocks and code spans (whose brackets are not links)."""
    return re.sub(r"``.*?``|`[^`\n]*`", "", unfenced(text))


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", unfenced(page.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")  # backticks go too
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


def links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page.read_text())) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
            broken.append(f"{target}: no such heading in {file.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: {broken}"


def test_the_link_check_sees_a_broken_link(tmp_path):
    """The check itself: a link to a missing heading is found, one inside a code span is not a link."""
    page = tmp_path / "page.md"
    page.write_text("# A page's title\n\n[here](#a-pages-title) [gone](#nowhere) `[code](#x)`\n")
    assert anchors(page) == {"a-pages-title"}
    assert links(page) == ["#a-pages-title", "#nowhere"]


# families that ComfyUI 0a674689 (the version STACK-NOTES records) has no model for, and the Wan
# variant musubi-tuner does not train: the README must not send a user's file to either
NOT_IN_COMFYUI = ("Qwen-Image 2.1", "Krea 2", "Ideogram 4")


def file_table(readme: str) -> dict[str, dict[str, str]]:
    """README's "Which file in which tool" table: family -> column -> cell."""
    section = readme.split("### Which file in which tool", 1)[1]
    rows = [re.split(r"(?<!\\)\|", line)[1:-1] for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in rows[0]]
    return {cells[0].strip(): dict(zip(header, (c.strip() for c in cells))) for cells in rows[2:]}


def test_readme_file_table_names_only_tools_that_have_the_model():
    table = file_table((REPO / "README.md").read_text())
    for family in NOT_IN_COMFYUI:
        assert table[family]["ComfyUI"].startswith("none"), f"README says ComfyUI loads {family}"
    wan = table["Wan"]["ComfyUI"]
    assert "musubi" not in wan or "no TI2V-5B" in wan, "README calls Wan 2.2 TI2V-5B's _kohya musubi-tuner's"
