"""A small PNG line plot on log-log axes, written with zlib + struct (no plotting library).

`line_panels(panels, path)`: panels side by side, each a title and named series of (x, y) points,
both axes log10, a grid line at every power of ten labelled 1, 10, 100, 1K, 1M ... The text uses a
3x5 pixel font (digits, capital letters, a few signs) scaled 2x; colours come from a fixed cycle.
"""

from __future__ import annotations

import itertools
import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

_FONT = {
    "0": "111101101101111",
    "1": "010110010010111",
    "2": "111001111100111",
    "3": "111001111001111",
    "4": "101101111001001",
    "5": "111100111001111",
    "6": "111100111101111",
    "7": "111001001001001",
    "8": "111101111101111",
    "9": "111101111001111",
    "A": "010101111101101",
    "B": "110101110101110",
    "C": "111100100100111",
    "D": "110101101101110",
    "E": "111100110100111",
    "F": "111100110100100",
    "G": "111100101101111",
    "H": "101101111101101",
    "I": "111010010010111",
    "K": "101101110101101",
    "L": "100100100100111",
    "M": "101111111101101",
    "N": "110101101101101",
    "O": "111101101101111",
    "P": "111101111100100",
    "R": "110101110101101",
    "S": "111100111001111",
    "T": "111010010010010",
    "U": "101101101101111",
    "V": "101101101101010",
    "W": "101101111111101",
    "X": "101101010101101",
    "Y": "101101010010010",
    "Z": "111001010100111",
    ".": "000000000000010",
    "-": "000000111000000",
    "/": "001001010100100",
    " ": "000000000000000",
    "(": "010100100100010",
    ")": "010001001001010",
    "_": "000000000000111",
    ":": "000010000010000",
}
_COLOURS = [
    (31, 119, 180),
    (214, 39, 40),
    (44, 160, 44),
    (148, 103, 189),
    (255, 127, 14),
    (23, 190, 207),
]
_GREY, _BLACK, _WHITE = (220, 220, 220), (0, 0, 0), (255, 255, 255)


@dataclass(frozen=True, kw_only=True)
class Panel:
    title: str
    x_label: str
    y_label: str
    series: dict[str, list[tuple[float, float]]]
    """Series name -> (x, y) points; non-positive values are skipped (log axes)."""


class _Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(_WHITE * (width * height))

    def dot(self, x: int, y: int, colour: tuple[int, int, int], size: int = 1) -> None:
        for dx in range(size):
            for dy in range(size):
                px, py = x + dx, y + dy
                if 0 <= px < self.width and 0 <= py < self.height:
                    i = 3 * (py * self.width + px)
                    self.pixels[i : i + 3] = bytes(colour)

    def line(self, x0, y0, x1, y1, colour, width: int = 1) -> None:
        steps = max(abs(x1 - x0), abs(y1 - y0), 1)
        for s in range(steps + 1):
            self.dot(
                round(x0 + (x1 - x0) * s / steps), round(y0 + (y1 - y0) * s / steps), colour, width
            )

    def text(self, x: int, y: int, text: str, colour=_BLACK, scale: int = 2) -> None:
        for c in text.upper():
            glyph = _FONT.get(c, _FONT[" "])
            for row in range(5):
                for col in range(3):
                    if glyph[row * 3 + col] == "1":
                        self.dot(x + col * scale, y + row * scale, colour, scale)
            x += 4 * scale

    def png(self) -> bytes:
        raw = b"".join(
            b"\x00" + bytes(self.pixels[3 * y * self.width : 3 * (y + 1) * self.width])
            for y in range(self.height)
        )

        def chunk(kind: bytes, data: bytes) -> bytes:
            body = kind + data
            return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(raw, 9))
            + chunk(b"IEND", b"")
        )


def _label(value: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= size:
            return f"{value / size:g}{unit}"
    return f"{value:g}"


def line_panels(panels: Sequence[Panel], path: Path | str, *, panel_size=(520, 420)) -> None:
    """Write the panels side by side as one PNG at `path`."""
    pw, ph = panel_size
    canvas = _Canvas(pw * len(panels), ph)
    for p, panel in enumerate(panels):
        _draw_panel(canvas, panel, p * pw, pw, ph)
    Path(path).write_bytes(canvas.png())


def _draw_panel(canvas: _Canvas, panel: Panel, left: int, pw: int, ph: int) -> None:
    # Step 1: data range in log10, widened to whole decades.
    points = [(x, y) for pts in panel.series.values() for x, y in pts if x > 0 and y > 0]
    canvas.text(left + 20, 8, panel.title)
    if not points:
        return
    lx = [math.log10(x) for x, _ in points]
    ly = [math.log10(y) for _, y in points]
    x0, x1 = math.floor(min(lx)), math.ceil(max(lx))
    y0, y1 = math.floor(min(ly)), math.ceil(max(ly))
    x1, y1 = max(x1, x0 + 1), max(y1, y0 + 1)
    ox, oy, w, h = left + 70, 40, pw - 100, ph - 110

    def to_px(x: float, y: float) -> tuple[int, int]:
        return (
            round(ox + (math.log10(x) - x0) / (x1 - x0) * w),
            round(oy + h - (math.log10(y) - y0) / (y1 - y0) * h),
        )

    # Step 2: decade grid and labels, then axes.
    for e in range(x0, x1 + 1):
        px, _ = to_px(10.0**e, 10.0**y0)
        canvas.line(px, oy, px, oy + h, _GREY)
        canvas.text(px - 8, oy + h + 6, _label(10.0**e))
    for e in range(y0, y1 + 1):
        _, py = to_px(10.0**x0, 10.0**e)
        canvas.line(ox, py, ox + w, py, _GREY)
        canvas.text(left + 4, py - 5, _label(10.0**e))
    canvas.line(ox, oy, ox, oy + h, _BLACK)
    canvas.line(ox, oy + h, ox + w, oy + h, _BLACK)
    canvas.text(ox + w // 2 - 40, oy + h + 22, panel.x_label)
    canvas.text(left + 4, oy - 16, panel.y_label)
    # Step 3: each series as a polyline with markers, and its legend entry.
    for i, (name, pts) in enumerate(panel.series.items()):
        colour = _COLOURS[i % len(_COLOURS)]
        pixels = [to_px(x, y) for x, y in pts if x > 0 and y > 0]
        for (ax, ay), (bx, by) in itertools.pairwise(pixels):
            canvas.line(ax, ay, bx, by, colour, 2)
        for px, py in pixels:
            canvas.dot(px - 2, py - 2, colour, 5)
        ly_legend = ph - 40 + 14 * (i // 3)
        lx_legend = left + 20 + 160 * (i % 3)
        canvas.line(lx_legend, ly_legend + 5, lx_legend + 16, ly_legend + 5, colour, 3)
        canvas.text(lx_legend + 22, ly_legend, name, colour)
