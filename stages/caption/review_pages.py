"""The review's two renderings of the same sections: an HTML page with the thumbnails, and
markdown tables for the Prefect UI. Every text from the data (captions, paths, details) is escaped."""
from __future__ import annotations

import html
import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    """One sample as the review shows it."""

    id: str
    label: str  # its file, as the user knows it (sample_label)
    split: str
    size: str  # its bucket, WxH
    caption: str
    source: str  # captions.json's: written, generated, replace, prefix, suffix or combine
    written: str | None
    generated: str | None
    thumbnail: str  # a data: URI, or "" when the image cannot be shown
    problem: str  # why there is no thumbnail


@dataclass(frozen=True)
class Review:
    rows: list[Row]
    buckets: list[tuple[str, int]]  # (WxH, images), smallest area first
    lengths: list[tuple[str, int]]  # (words range, captions)
    sources: list[tuple[str, int]]  # (caption source, images)
    rejected: list[dict]  # preprocess's report.json entries: path, reason, detail
    warnings: list[dict]
    captioner: dict


SOURCE_NOTE = {  # captions.json's source -> where the final caption came from
    "written": "written by the user",
    "generated": "generated (the image had no written caption)",
    "replace": "generated, in place of the written caption (policy replace)",
    "prefix": "caption_text, then the generated caption (policy prefix)",
    "suffix": "the generated caption, then caption_text (policy suffix)",
    "combine": "the written caption, then the generated one (policy combine)",
}
BAR_WIDTH = 30  # characters of the longest markdown histogram bar
STYLE = """body{font-family:sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse;margin:.5em 0}
td,th{border:1px solid #ccc;padding:.2em .6em;text-align:left;vertical-align:top}
.grid{display:flex;flex-wrap:wrap;gap:12px}figure{margin:0;width:180px}
figure img{display:block;max-width:160px;max-height:160px}figcaption{font-size:13px}
.meta{color:#666;font-size:11px}
.missing{width:160px;height:60px;background:#eee;font-size:11px}"""


def sections(review: Review) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, column headers, rows of plain text cells) of every table both pages show."""
    peak = max((n for _, n in review.lengths), default=0) or 1
    return [
        ("Captioner", ["setting", "value"], [[k, v if isinstance(v, str) else json.dumps(v, sort_keys=True)]
                                            for k, v in sorted(review.captioner.items())]),
        ("Caption sources", ["source", "images", "meaning"],
         [[s, str(n), SOURCE_NOTE.get(s, "")] for s, n in review.sources]),
        ("Buckets", ["size (WxH)", "images"], [[size, str(n)] for size, n in review.buckets]),
        ("Caption length (words)", ["words", "captions", ""],
         [[words, str(n), "\u2588" * round(BAR_WIDTH * n / peak)] for words, n in review.lengths]),
        ("Rejected by preprocess", ["file", "reason", "detail"],
         [[r["path"], r["reason"], r.get("detail", "")] for r in review.rejected]),
        ("Warnings", ["file", "reason", "detail"], [[w["path"], w["reason"], w.get("detail", "")] for w in review.warnings]),
    ]


def summary(review: Review) -> str:
    held = sum(row.split == "holdout" for row in review.rows)
    return (f"{len(review.rows)} images ({len(review.rows) - held} train, {held} held out); "
            f"{len(review.rejected)} rejected, {len(review.warnings)} warning(s).")


def markdown_page(review: Review) -> str:
    lines = ["# Dataset review", "", summary(review)]
    for title, headers, rows in [*sections(review), ("Images", ["image", "split", "size", "source", "caption"],
                                                     [[r.label, r.split, r.size, r.source, r.caption]
                                                      for r in review.rows])]:
        lines += ["", f"## {title}", ""]
        lines += _markdown_table(headers, rows) if rows else ["None."]
    return "\n".join(lines) + "\n"


def _markdown_table(headers: list[str], rows: list[list[str]]) -> list[str]:
    return [_markdown_row(headers), "|---" * len(headers) + "|", *(_markdown_row(r) for r in rows)]


def _markdown_row(cells: list[str]) -> str:
    """A table row; each cell on one line, its HTML and its pipes escaped (a caption is data, not markup)."""
    return "| " + " | ".join(html.escape(" ".join(c.split())).replace("|", "\\|") for c in cells) + " |"


def html_page(review: Review) -> str:
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8"><title>Dataset review</title>',
             f"<style>{STYLE}</style></head><body>", "<h1>Dataset review</h1>", f"<p>{_e(summary(review))}</p>"]
    for title, headers, rows in sections(review):
        parts.append(f"<h2>{_e(title)}</h2>")
        parts.append(_html_table(headers, rows) if rows else "<p>None.</p>")
    parts += ["<h2>Images</h2>", '<div class="grid">', *(_figure(row) for row in review.rows), "</div>",
              "</body></html>"]
    return "\n".join(parts) + "\n"


def _html_table(headers: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _figure(row: Row) -> str:
    shown = (f'<img src="{row.thumbnail}" alt="{_e(row.label)}" data-id="{_e(row.id)}">' if row.thumbnail
             else f'<div class="missing">{_e(row.problem)}</div>')
    parts = [f'<figure class="source-{_e(row.source)}">', shown, f"<figcaption>{_e(row.caption)}",
             f'<div class="meta">{_e(row.label)} &middot; {_e(row.split)} &middot; {_e(row.size)} &middot;'
             f' <span title="{_e(SOURCE_NOTE.get(row.source, ""))}">{_e(row.source)}</span></div>']
    if row.source not in ("written", "generated"):
        parts.append(f'<div class="meta">written: {_e(row.written or "(none)")}<br>'
                     f'generated: {_e(row.generated or "(none)")}</div>')
    return "".join(parts) + "</figcaption></figure>"


def _e(text: str) -> str:
    return html.escape(text, quote=True)
