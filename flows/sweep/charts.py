"""Line charts as inline SVG: a page that draws them needs no script, library or network."""
from __future__ import annotations

import html
import math
from collections.abc import Callable
from dataclasses import dataclass

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf")  # matplotlib's tab10: one colour per variant, the same in every chart
WIDTH, HEIGHT = 720, 320
LEFT, RIGHT, TOP, BOTTOM = 70, 220, 20, 45  # margins: tick labels left and below, the legend right
TICKS = 5


@dataclass(frozen=True)
class Series:
    label: str
    points: list[tuple[float, float]]  # (x, y)
    colour: str
    dashed: bool = False


def colour(index: int) -> str:
    return PALETTE[index % len(PALETTE)]


def line_chart(series: list[Series], x_label: str, y_label: str) -> str:
    """An SVG chart of every series with points, on shared axes, with a legend; a note without any."""
    drawn = [s for s in series if s.points]
    if not drawn:
        return '<p class="missing">No variant has these values.</p>'
    xs = _span([x for s in drawn for x, _ in s.points])
    ys = _span([y for s in drawn for _, y in s.points])

    def at(x: float, y: float) -> tuple[float, float]:
        return (LEFT + (x - xs[0]) / (xs[1] - xs[0]) * (WIDTH - LEFT - RIGHT),
                HEIGHT - BOTTOM - (y - ys[0]) / (ys[1] - ys[0]) * (HEIGHT - TOP - BOTTOM))

    parts = [f'<svg width="{WIDTH}" height="{HEIGHT}" role="img" font-family="sans-serif" font-size="11"'
             ' style="overflow:visible">', *_axes(xs, ys, at, x_label, y_label)]  # a long name runs on to the right
    for index, s in enumerate(drawn):
        dash = ' stroke-dasharray="5,4"' if s.dashed else ""
        points = " ".join("{:.1f},{:.1f}".format(*at(x, y)) for x, y in s.points)
        parts.append(f'<polyline fill="none" stroke="{s.colour}" stroke-width="1.5"{dash} points="{points}">'
                     f"<title>{html.escape(s.label)}</title></polyline>")
        if len(s.points) == 1:  # a single point draws no line
            cx, cy = at(*s.points[0])
            parts.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="3" fill="{s.colour}"/>')
        y = TOP + 14 * index + 8
        parts.append(f'<line x1="{WIDTH - RIGHT + 12}" y1="{y}" x2="{WIDTH - RIGHT + 32}" y2="{y}"'
                     f' stroke="{s.colour}" stroke-width="2"{dash}/>'
                     f'<text x="{WIDTH - RIGHT + 38}" y="{y + 4}">{html.escape(s.label)}</text>')
    return "\n".join([*parts, "</svg>"])


def _span(values: list[float]) -> tuple[float, float]:
    """The axis range: the values' with a margin of 5%, never empty."""
    low, high = min(values), max(values)
    pad = (high - low) * 0.05 or abs(high) * 0.01 or 1.0
    return low - pad, high + pad


def _axes(xs: tuple[float, float], ys: tuple[float, float], at: Callable[[float, float], tuple[float, float]],
          x_label: str, y_label: str) -> list[str]:
    left, right, bottom = LEFT, WIDTH - RIGHT, HEIGHT - BOTTOM
    parts = [f'<rect x="{left}" y="{TOP}" width="{right - left}" height="{bottom - TOP}" fill="none" stroke="#999"/>']
    for x in _ticks(*xs):
        px = at(x, ys[0])[0]
        parts.append(f'<text x="{px:.1f}" y="{bottom + 15}" text-anchor="middle">{x:.6g}</text>')
    for y in _ticks(*ys):
        py = at(xs[0], y)[1]
        parts.append(f'<line x1="{left}" y1="{py:.1f}" x2="{right}" y2="{py:.1f}" stroke="#eee"/>'
                     f'<text x="{left - 5}" y="{py + 4:.1f}" text-anchor="end">{y:.6g}</text>')
    parts.append(f'<text x="{(left + right) / 2}" y="{HEIGHT - 8}" text-anchor="middle">{html.escape(x_label)}</text>')
    parts.append(f'<text transform="translate(14,{(TOP + bottom) / 2}) rotate(-90)" text-anchor="middle">'
                 f"{html.escape(y_label)}</text>")
    return parts


def _ticks(low: float, high: float) -> list[float]:
    """Round values in [low, high], 1, 2 or 5 times a power of ten apart, about TICKS of them."""
    rough = (high - low) / TICKS
    power = 10 ** math.floor(math.log10(rough))
    step = min((m * power for m in (1, 2, 5, 10)), key=lambda step: abs(math.log(step / rough)))
    first = math.ceil(low / step) * step
    return [round(first + i * step, 12) for i in range(int((high - first) / step + 1e-9) + 1)]
