"""sweep-report.html: one self-contained file a person opens or mails (its charts inline SVG, its
grids data: URIs, no script). Every text from a variant (its name, settings, error) is escaped."""
from __future__ import annotations

import html
from dataclasses import dataclass

from lorapipe.stages.evaluate.report import data_uri

from .charts import Series, colour, line_chart
from .outcome import VariantOutcome
from .scores import CURVE_POINTS, VariantFiles

GRID_MAX_SIDE = 1024  # px: wider than a grid beside the others is shown (the page scales it down, never up)
GRID_MAX_BYTES = 500_000  # per grid before base64: the page with every variant's grid stays mailable
BASE = "#555"  # the base model's dashed line
# a long path (a failed variant's error) breaks anywhere rather than widening the page
STYLE = """body{font-family:sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse;margin:.5em 0}
td,th{border:1px solid #ccc;padding:.2em .6em;text-align:left;vertical-align:top;overflow-wrap:anywhere}
tr.best td{background:#fff3b0;font-weight:bold}tr.failed td{color:#a00}
.swatch{display:inline-block;width:.8em;height:.8em;margin-right:.4em}
.grids{display:flex;gap:16px;align-items:flex-start}.grids figure{margin:0;flex:1 1 0;min-width:240px}
.grids img{max-width:100%;height:auto}figcaption{font-size:14px;margin-bottom:.3em}
figure.best figcaption{font-weight:bold}.note{color:#666}
.missing{background:#eee;padding:1em;font-size:12px;overflow-wrap:anywhere}"""


@dataclass(frozen=True)
class Row:
    """One variant as the report shows it."""

    outcome: VariantOutcome
    files: VariantFiles
    score: float | None  # by the sweep's metric
    best: bool


def html_page(rows: list[Row], table: tuple[list[str], list[list[str]]], headline: str) -> str:
    """The page: `headline`, the `table` (plain text cells, one row per variant as in `rows`), the charts, the grids."""
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8"><title>Sweep report</title>',
             f"<style>{STYLE}</style></head><body>", "<h1>Sweep report</h1>", f"<p>{_e(headline)}</p>",
             _html_table(rows, table),
             "<h2>Training loss</h2>",
             f'<p class="note">Each step\'s loss (train\'s logs/loss.jsonl); a run of more than {CURVE_POINTS} steps'
             f" as the means of at most {CURVE_POINTS} bins of consecutive steps.</p>",
             line_chart([Series(r.outcome.name, r.files.curve, colour(i)) for i, r in enumerate(rows)],
                        "step", "training loss"),
             "<h2>Held-out loss by checkpoint</h2>", line_chart(_checkpoint_series(rows), "step", "held-out loss"),
             "<h2>Sample grids</h2>",
             '<p class="note">The same prompts and seeds in every variant: the base model, then the LoRA at each'
             " scale.</p>",
             '<div class="grids">', *(_grid(row) for row in rows), "</div>", "</body></html>"]
    return "\n".join(parts) + "\n"


def _html_table(rows: list[Row], table: tuple[list[str], list[list[str]]]) -> str:
    """The table, each row marked by its class (best, ok, failed), its variant's name by its colour in the charts."""
    headers, cells = table
    name_at = headers.index("variant")
    lines = ["<table>", "<tr>" + "".join(f"<th>{_e(h)}</th>" for h in headers) + "</tr>"]
    for index, (row, texts) in enumerate(zip(rows, cells)):
        texts = [_e(t) for t in texts]
        texts[name_at] = f'<span class="swatch" style="background:{colour(index)}"></span>{texts[name_at]}'
        lines.append(f'<tr class="{_row_class(row)}" data-variant="{_e(row.outcome.name)}">'
                     + "".join(f"<td>{t}</td>" for t in texts) + "</tr>")
    return "\n".join([*lines, "</table>"])


def _row_class(row: Row) -> str:
    return "best" if row.best else "ok" if row.outcome.succeeded else "failed"


def _checkpoint_series(rows: list[Row]) -> list[Series]:
    """Each variant's held-out loss by checkpoint step, and the base model's as a dashed line across them
    (from step 0, the base itself, where every variant has one checkpoint at one step: else a dot)."""
    series = [Series(row.outcome.name, [(c["step"], c["overall"]) for c in row.files.checkpoints["checkpoints"]],
                     colour(index))
              for index, row in enumerate(rows) if row.files.checkpoints and "checkpoints" in row.files.checkpoints]
    steps = [x for s in series for x, _ in s.points]
    bases = sorted({row.files.checkpoints["base"] for row in rows
                    if row.files.checkpoints and "base" in row.files.checkpoints})
    start = min(steps) if len(set(steps)) > 1 else 0
    return series + [Series("base model", [(start, b), (max(steps), b)], BASE, dashed=True)
                     for b in bases if steps]


def _grid(row: Row) -> str:
    """The variant's sample grid as a figure, or a line saying why there is none."""
    if row.files.grid is None:
        return _figure(row, _missing("no sample grid" + ("" if row.outcome.succeeded else
                                                         f" (failed: {row.outcome.error})")))
    try:
        uri, note = data_uri(row.files.grid, GRID_MAX_SIDE, GRID_MAX_BYTES)
    except OSError as error:  # a damaged or unreadable file: the rest of the page still shows
        return _figure(row, _missing(f"{row.files.grid.name} could not be shown ({error})"))
    name = _e(row.outcome.name)
    return _figure(row, f'<img src="{uri}" alt="sample grid of {name}" data-variant="{name}">'
                   + (f'<div class="note">{_e(note)}</div>' if note else ""))


def _figure(row: Row, content: str) -> str:
    caption = _e(row.outcome.name) + (" \u2605 best" if row.best else "")
    return f'<figure class="{_row_class(row)}"><figcaption>{caption}</figcaption>{content}</figure>'


def _missing(why: str) -> str:
    return f'<div class="missing">{_e(why)}</div>'


def _e(text: str) -> str:
    return html.escape(text, quote=True)
