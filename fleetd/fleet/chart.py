"""A grouped bar chart as a PNG file, with numpy and zlib only (no plotting library in the
venv, and one chart does not justify one): one panel per metric, each with its own scale, one
bar per arm at the median, a whisker from min to max, a y axis with round values, the values
written above the bars in a 3x5 pixel font.

    write_bar_chart(path, "title", {"prompt tok/s": {"hub": (m, lo, hi), "direct": (...)}, ...})
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Mapping
from pathlib import Path

import numpy as np

# 3x5 glyphs, rows top to bottom; unknown characters draw as blanks.
_FONT = {
    "0": "111101101101111",
    "1": "010110010010111",
    "2": "111001111100111",
    "3": "111001111001111",
    "4": "101101111001001",
    "5": "111100111001111",
    "6": "111100111101111",
    "7": "111001001010010",
    "8": "111101111101111",
    "9": "111101111001111",
    "a": "010101111101101",
    "b": "110101110101110",
    "c": "011100100100011",
    "d": "110101101101110",
    "e": "111100110100111",
    "f": "111100110100100",
    "g": "011100101101011",
    "h": "101101111101101",
    "i": "111010010010111",
    "j": "001001001101010",
    "k": "101101110101101",
    "l": "100100100100111",
    "m": "101111111101101",
    "n": "110101101101101",
    "o": "010101101101010",
    "p": "110101110100100",
    "q": "010101101110011",
    "r": "110101110101101",
    "s": "011100010001110",
    "t": "111010010010010",
    "u": "101101101101111",
    "v": "101101101101010",
    "w": "101101111111101",
    "x": "101101010101101",
    "y": "101101010010010",
    "z": "111001010100111",
    ".": "000000000000010",
    ":": "000010000010000",
    "/": "001001010100100",
    "-": "000000111000000",
    "(": "010100100100010",
    ")": "010001001001010",
    "%": "101001010100101",
    ",": "000000000010100",
    "=": "000111000111000",
    "+": "000010111010000",
    "_": "000000000000111",
    "'": "010010000000000",
    "?": "111001011000010",
    "#": "101111101111101",
    "<": "001010100010001",
    ">": "100010001010100",
    "!": "010010010000010",
}
ARM_COLOURS = [(70, 110, 190), (230, 140, 40), (90, 170, 90), (170, 70, 160)]
INK, GRID, PAPER = (30, 30, 30), (215, 215, 215), (255, 255, 255)


def png_bytes(image: np.ndarray) -> bytes:
    """RGB uint8 (h, w, 3) -> a PNG file's bytes (filter 0 on every row)."""
    h, w, _ = image.shape
    raw = np.concatenate([np.zeros((h, 1), np.uint8), image.reshape(h, w * 3)], axis=1).tobytes()

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )


def _text(
    img: np.ndarray, x: int, y: int, text: str, scale: int = 2, colour=INK, centre: bool = False
) -> None:
    if centre:
        x -= len(text) * 4 * scale // 2
    for ch in text.lower():
        glyph = _FONT.get(ch)
        if glyph:
            for i, bit in enumerate(glyph):
                if bit == "1":
                    r, c = divmod(i, 3)
                    y0, x0 = y + r * scale, x + c * scale
                    if 0 <= y0 and y0 + scale <= img.shape[0] and 0 <= x0 and x0 + scale <= img.shape[1]:
                        img[y0 : y0 + scale, x0 : x0 + scale] = colour
        x += 4 * scale


def _fmt(v: float) -> str:
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def y_ticks(peak: float, most: int = 5) -> list[float]:
    """Round values for a y axis from 0 to at least `peak`: steps of 1, 2 or 5 times a power of
    ten, at most `most` of them above 0."""
    if peak <= 0:
        return [0.0, 1.0]
    magnitude = 10.0 ** np.floor(np.log10(peak / most))
    step = next(m * magnitude for m in (1, 2, 5, 10) if peak / (m * magnitude) <= most)
    count = int(np.ceil(peak / step - 1e-9))
    return [float(i * step) for i in range(count + 1)]


def _tick_label(v: float, step: float) -> str:
    return f"{v:.0f}" if step >= 1 else f"{v:.{int(np.ceil(-np.log10(step)))}f}"


def render_bar_chart(
    title: str,
    panels: Mapping[str, Mapping[str, tuple[float, float, float]]],
    width: int | None = None,
    height: int = 440,
) -> np.ndarray:
    """An RGB image of one panel per metric, a bar per arm at its median with a min..max whisker;
    960 pixels wide unless the panels' labels need more."""
    if width is None:
        label = max(map(len, panels), default=0) * 8 + 24  # 8 pixels a character at scale 2
        width = max(960, 32 + len(panels) * label)
    img = np.full((height, width, 3), PAPER, np.uint8)
    _text(img, 16, 12, title, 2)
    arms = list(dict.fromkeys(a for p in panels.values() for a in p))
    # legend, top right; on a line of its own below a title that would run into it
    legend_y = 14 if 16 + len(title) * 8 + 16 <= width - 16 - len(arms) * 120 else 34
    for i, arm in enumerate(arms):
        x = width - 16 - (len(arms) - i) * 120
        img[legend_y : legend_y + 10, x : x + 10] = ARM_COLOURS[i % len(ARM_COLOURS)]
        _text(img, x + 16, legend_y, arm, 2)
    top, bottom = 60, height - 50
    panel_w = (width - 32) // max(1, len(panels))
    for p, (label, values) in enumerate(panels.items()):
        left = 16 + p * panel_w
        ticks = y_ticks(max((hi for _, _, hi in values.values()), default=0.0))
        top_value = ticks[-1]
        scale = (bottom - top) / 1.1 / top_value
        axis = left + 44  # the y axis: its values right-aligned to its left
        img[bottom, axis : left + panel_w - 10] = INK
        img[top : bottom + 1, axis] = INK
        for v in ticks:
            y = int(bottom - v * scale)
            if v > 0:
                img[y, axis + 1 : left + panel_w - 10] = GRID
            text = _tick_label(v, ticks[1] - ticks[0])
            _text(img, axis - 4 - len(text) * 8, y - 5, text, 2)
        bar_w = (panel_w - 70) // max(1, len(arms))
        for i, arm in enumerate(arms):
            if arm not in values:
                continue
            median, lo, hi = values[arm]
            x0 = axis + 6 + i * bar_w
            y_med, y_lo, y_hi = (int(bottom - v * scale) for v in (median, lo, hi))
            img[y_med:bottom, x0 + 6 : x0 + bar_w - 6] = ARM_COLOURS[i % len(ARM_COLOURS)]
            cx = x0 + bar_w // 2
            img[y_hi : y_lo + 1, cx - 1 : cx + 1] = INK  # whisker: min..max over rounds
            img[y_hi, cx - 8 : cx + 8] = INK
            img[y_lo, cx - 8 : cx + 8] = INK
            _text(img, cx, max(top - 18, y_hi - 16), _fmt(median), 2, centre=True)
        _text(img, left + panel_w // 2, bottom + 14, label, 2, centre=True)
    return img


def write_bar_chart(
    path: str | Path, title: str, panels: Mapping[str, Mapping[str, tuple[float, float, float]]]
) -> Path:
    path = Path(path)
    path.write_bytes(png_bytes(render_bar_chart(title, panels)))
    return path
