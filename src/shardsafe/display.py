"""Text shown to people: aligned tables, byte sizes, one-line text and the terminal columns a text takes,
for the ``shardsafe`` command, progress lines and the progress bar. Imports nothing of shardsafe."""

from __future__ import annotations

import unicodedata
from collections.abc import Collection, Sequence

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def binary_size(n: float) -> str:
    """``n`` bytes (or bytes per second) in the largest binary unit it reaches: ``512 B``, ``3.0 MiB``."""
    size, i = float(n), 0
    while abs(size) >= 1024 and i < len(_UNITS) - 1:
        size, i = size / 1024, i + 1
    return f"{size:.0f} B" if i == 0 else f"{size:.1f} {_UNITS[i]}"


def exact_size(n: int) -> str:
    """``n`` bytes, exactly, plus the binary-unit rounding when that reads easier:
    ``3145728 bytes (3.0 MiB)``."""
    return f"{n} bytes" if n < 1024 else f"{n} bytes ({binary_size(n)})"


def table(rows: Sequence[Sequence[str]], *, right: Collection[int] = (), pad_last: bool = True) -> list[str]:
    """``rows`` (the first one the header) as lines of columns two spaces apart, each column as wide as
    its widest cell; columns in ``right`` are right-aligned. With ``pad_last=False`` the last column
    is not padded (free text such as metrics). Trailing spaces are cut."""
    padded = len(rows[0]) if pad_last else len(rows[0]) - 1
    widths = [max(len(row[i]) for row in rows) for i in range(padded)]
    lines = []
    for row in rows:
        cells = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row[:padded], widths, strict=True))
        ]
        lines.append("  ".join([*cells, *row[padded:]]).rstrip())
    return lines


def _char_columns(c: str) -> int:
    if unicodedata.combining(c) or unicodedata.category(c) in ("Mn", "Me", "Cf"):
        return 0
    return 2 if unicodedata.east_asian_width(c) in ("W", "F") else 1


def columns(text: str) -> int:
    """The terminal columns ``text`` (printable characters, one line) takes: a wide East Asian character
    takes two, a combining mark none."""
    return sum(_char_columns(c) for c in text)


def one_line(text: str) -> str:
    """``text`` as one line of printable characters (a name from a hostile file may hold line breaks or
    terminal escapes): line breaks become `` | ``, other control characters their escape sequence."""
    joined = " | ".join(line.strip() for line in text.splitlines() if line.strip())
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in joined)


def cut(text: str, width: int) -> str:
    """The longest start of ``text`` that takes at most ``width`` terminal columns (see :func:`columns`)."""
    used = 0
    for i, c in enumerate(text):
        used += _char_columns(c)
        if used > width:
            return text[:i]
    return text
