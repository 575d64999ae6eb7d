"""The review's two renderings of the same sections: HTML pages with the thumbnails, and markdown
tables for the Prefect UI. Every text from the data (captions, paths, details) is escaped: with
HTML entities in the pages, with markdown's backslash escapes in the markdown (which a reader also
reads as text, so no `&quot;` there). An empty caption is shown as such, never as a blank.

Both are bounded however many images there are (Paging): review.html holds the summary tables and
the first page of thumbnails, review-2.html, review-3.html, ... the next pages, each linking to
every other; past the last page the remaining images are rows of its table, without thumbnails.
The markdown lists the first page's images and says where the rest are."""
from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass


REVIEW_HTML = "review.html"  # the first page


@dataclass(frozen=True)
class Paging:
    """How the review splits its images: at most `page_size` thumbnails a page, at most `max_pages` pages."""

    page_size: int = 200
    max_pages: int = 50

    @property
    def thumbnails(self) -> int:
        """The images shown as thumbnails; the later ones are rows without one."""
        return self.page_size * self.max_pages

    def pages(self, images: int) -> int:
        return max(1, min(self.max_pages, -(-images // self.page_size)))


def page_name(page: int) -> str:
    """The file of page `page` (from 1): review.html, review-2.html, ..."""
    return REVIEW_HTML if page == 1 else REVIEW_HTML.replace(".html", f"-{page}.html")


PAGE_FILES = tuple(page_name(page) for page in range(1, Paging().max_pages + 1))  # every file the review may write
IMAGE_HEADERS = ["image", "split", "size", "source", "caption"]


@dataclass(frozen=True)
class Row:
    """One sample as the review shows it."""

    id: str
    label: str  # its file, as the user knows it (ImageRow.label)
    split: str
    size: str  # its bucket, WxH
    caption: str
    source: str  # captions.json's: written, generated, replace, prefix, suffix or combine
    written: str | None
    generated: str | None
    thumbnail: str  # a data: URI, or "" when the image cannot be shown or is past Paging.thumbnails
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
    "left_out": "not captioned: the image could not be read (its written caption, or empty; Warnings says why)",
}
EMPTY = "(empty caption)"  # how a caption of no words is shown: distinct from a caption's own text in the page
BAR_WIDTH = 30  # characters of the longest markdown histogram bar
STYLE = """body{font-family:sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse;margin:.5em 0}
td,th{border:1px solid #ccc;padding:.2em .6em;text-align:left;vertical-align:top}
.grid{display:flex;flex-wrap:wrap;gap:12px}figure{margin:0;width:180px}
figure img{display:block;max-width:160px;max-height:160px}figcaption{font-size:13px;overflow-wrap:anywhere}
.meta{color:#666;font-size:11px}.empty{color:#a00;font-style:italic}
.missing{width:160px;height:60px;background:#eee;font-size:11px}nav{margin:.8em 0}nav a,nav b{margin-right:.4em}"""


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


def markdown_page(review: Review, paging: Paging = Paging()) -> str:
    lines = ["# Dataset review", "", summary(review)]
    listed = review.rows[:paging.page_size]
    for title, headers, rows in [*sections(review), ("Images", IMAGE_HEADERS, [_image_cells(r) for r in listed])]:
        lines += ["", f"## {title}", ""]
        lines += _markdown_table(headers, rows) if rows else ["None."]
    if len(listed) < len(review.rows):
        lines += ["", f"The first {len(listed)} of {len(review.rows)} images: {REVIEW_HTML} and its pages list every one."]
    return "\n".join(lines) + "\n"


def _image_cells(row: Row) -> list[str]:
    return [row.label, row.split, row.size, row.source, row.caption or EMPTY]


def _markdown_table(headers: list[str], rows: list[list[str]]) -> list[str]:
    return [_markdown_row(headers), "|---" * len(headers) + "|", *(_markdown_row(r) for r in rows)]


def _markdown_row(cells: list[str]) -> str:
    """A table row; each cell on one line, escaped (a caption is data, not markup)."""
    return "| " + " | ".join(_markdown_text(" ".join(c.split())) for c in cells) + " |"


MARKDOWN_SPECIAL = re.compile(r"[\\`<>|]|&(?=#?\w+;)")  # what could start markup, an HTML tag or an entity, or end a cell


def _markdown_text(text: str) -> str:
    """`text` as markdown shows it verbatim: backslash escapes (any ASCII punctuation may take one)."""
    return MARKDOWN_SPECIAL.sub(lambda m: "\\" + m.group(), text)


def html_pages(review: Review, paging: Paging = Paging()) -> list[str]:
    """Page 1 (the summary tables and the first thumbnails), then the next pages of thumbnails."""
    pages = paging.pages(len(review.rows))
    return [_html_page(review, paging, page, pages) for page in range(1, pages + 1)]


def _html_page(review: Review, paging: Paging, page: int, pages: int) -> str:
    heading = "Dataset review" + (f", page {page} of {pages}" if page > 1 else "")
    parts = ["<!DOCTYPE html>", f'<html lang="en"><head><meta charset="utf-8"><title>{heading}</title>',
             f"<style>{STYLE}</style></head><body>", f"<h1>{heading}</h1>", f"<p>{_e(summary(review))}</p>"]
    for title, headers, rows in sections(review) if page == 1 else []:
        parts.append(f"<h2>{_e(title)}</h2>")
        parts.append(_html_table(headers, rows) if rows else "<p>None.</p>")
    first = (page - 1) * paging.page_size
    shown = review.rows[first:first + paging.page_size]
    where = f"Images {first + 1}-{first + len(shown)} of {len(review.rows)}" if shown else "No images"
    nav = _page_links(page, pages, where)
    parts += ["<h2>Images</h2>", nav, '<div class="grid">', *(_figure(row) for row in shown), "</div>"]
    rest = review.rows[paging.thumbnails:] if page == pages else []
    if rest:
        parts += ["<h2>Images without thumbnails</h2>",
                  f"<p>The {len(rest)} images past the first {paging.thumbnails}.</p>",
                  _html_table(IMAGE_HEADERS, [_image_cells(r) for r in rest])]
    return "\n".join([*parts, nav, "</body></html>"]) + "\n"


def _page_links(page: int, pages: int, shown: str) -> str:
    """Where this page's images are in the whole, and a link to every other page."""
    links = " ".join(f"<b>{p}</b>" if p == page else f'<a href="{page_name(p)}">{p}</a>' for p in range(1, pages + 1))
    return f"<nav>{shown}." + (f" Pages: {links}" if pages > 1 else "") + "</nav>"


def _html_table(headers: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _figure(row: Row) -> str:
    shown = (f'<img src="{row.thumbnail}" alt="{_e(row.label)}" data-id="{_e(row.id)}">' if row.thumbnail
             else f'<div class="missing">{_e(row.problem)}</div>')
    caption = _e(row.caption) if row.caption else f'<span class="empty">{EMPTY}</span>'
    parts = [f'<figure class="source-{_e(row.source)}">', shown, f"<figcaption>{caption}",
             f'<div class="meta">{_e(row.label)} &middot; {_e(row.split)} &middot; {_e(row.size)} &middot;'
             f' <span title="{_e(SOURCE_NOTE.get(row.source, ""))}">{_e(row.source)}</span></div>']
    if row.source not in ("written", "generated"):
        parts.append(f'<div class="meta">written: {_e(row.written or "(none)")}<br>'
                     f'generated: {_e(row.generated or "(none)")}</div>')
    return "".join(parts) + "</figcaption></figure>"


def _e(text: str) -> str:
    return html.escape(text, quote=True)
