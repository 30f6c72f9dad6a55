"""Plain SVG for the pictures the site's hooks draw while it is built (docs/_hooks/pictures.py,
docs/_hooks/measured.py): rectangles, text and lines on a white page, one colour per rank.

An SVG drawn here is a file of the built site (mkdocs' ``File.generated``), shown by an
``<img>`` like the PNGs in docs/img: it needs no script and no font from another host.
"""

from __future__ import annotations

import html
import math

# one colour per rank (ranks 0-7), then grey for what every rank holds
RANK = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#eeca3b", "#9d755d")
SHARED = "#c8c8c8"
INK = "#222222"
KIND = {"F": "#4c9be8", "B": "#f5a142", "W": "#6cc46c", "send": "#bbbbbb", "recv": "#dddddd"}


def colour(rank: int) -> str:
    return RANK[rank % len(RANK)]


class Svg:
    """One picture: shapes added in drawing order, ``str()`` the SVG document."""

    def __init__(self, width: float, height: float, title: str):
        self.width = width
        self.height = height
        self.title = title
        self.items: list[str] = []

    def rect(self, x, y, w, h, fill, stroke="none", tip: str | None = None) -> None:
        tip_el = f"<title>{html.escape(tip)}</title>" if tip else ""
        self.items.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" '
                          f'fill="{fill}" stroke="{stroke}" stroke-width="0.6">{tip_el}</rect>')

    def text(self, x, y, s, size=11, anchor="start", bold=False, fill=INK) -> None:
        weight = ' font-weight="bold"' if bold else ""
        self.items.append(f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" '
                          f'text-anchor="{anchor}" fill="{fill}"{weight}>{html.escape(str(s))}</text>')

    def line(self, x1, y1, x2, y2, stroke="#888888", width=1.0, dash: str | None = None) -> None:
        d = f' stroke-dasharray="{dash}"' if dash else ""
        self.items.append(f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" '
                          f'stroke="{stroke}" stroke-width="{width}"{d}/>')

    def circle(self, x, y, r, fill) -> None:
        self.items.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{r}" fill="{fill}"/>')

    def polyline(self, points, stroke, width=1.5) -> None:
        pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
        self.items.append(f'<polyline points="{pts}" fill="none" stroke="{stroke}" '
                          f'stroke-width="{width}"/>')

    def legend(self, x, y, entries: list[tuple[str, str]], size=11) -> None:
        """Coloured squares with their labels, left to right from (x, y)."""
        for fill, label in entries:
            self.rect(x, y - size + 2, size, size, fill)
            self.text(x + size + 4, y, label, size)
            x += size + 12 + 6.5 * len(label)

    def __str__(self) -> str:
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{math.ceil(self.width)}" '
                f'height="{math.ceil(self.height)}" viewBox="0 0 {math.ceil(self.width)} '
                f'{math.ceil(self.height)}" font-family="sans-serif" role="img">'
                f"<title>{html.escape(self.title)}</title>"
                f'<rect width="100%" height="100%" fill="#ffffff"/>' + "".join(self.items)
                + "</svg>\n")


def cells(svg: Svg, x, y, owners, size: float, label: str, tip=None) -> float:
    """A matrix drawn as a grid of cells, each in its owner's colour (``owners``: a 2-D array of
    rank numbers, -1 for every rank); returns the height drawn, with its label above."""
    rows, cols = owners.shape
    svg.text(x, y - 4, label, 10)
    for i in range(rows):
        for j in range(cols):
            o = int(owners[i, j])
            svg.rect(x + j * size, y + i * size, size, size, SHARED if o < 0 else colour(o),
                     "#ffffff", tip(i, j, o) if tip else None)
    return rows * size
