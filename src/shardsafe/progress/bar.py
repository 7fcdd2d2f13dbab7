"""A progress bar for saves and loads on a terminal: pass ``progress=shardsafe.ProgressBar()``.

On a terminal it redraws one line in place (``\\r``) and ends it when the operation ends; the line is kept
one column narrower than the terminal (asked at every redraw, ``COLUMNS`` first), since a line that
wraps is redrawn only from its last row and leaves the rest behind: the bar shrinks first, then the
least telling fields go (the outcome of a finished operation stays), then a long label (``verify
<checkpoint name>``) is shortened in its middle, then the tail is cut. Off a
terminal (a log file, a pipe, CI) it writes plain lines, whole, without control characters, and only
for an operation that runs past ``SHARDSAFE_PROGRESS_INTERVAL`` (so quick saves leave the log alone).
On and off a terminal, a record that comes before the operation knows its total (a manifest being
read, an export being planned) is not shown: the bar starts when there is work.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import TextIO

from shardsafe.display import binary_size, columns, cut, one_line
from shardsafe.errors import InvalidArgumentError
from shardsafe.progress.record import Progress, ProgressCallback, describe

_MIN_BAR = 10
"""The bar is shrunk to fit a narrow terminal down to this many characters before fields are dropped."""
_MIN_LABEL = 12
"""A long operation label (``verify <name>``) is shortened in its middle, down to this many columns, before
the tail of the line is cut: the bar, the percentage and the outcome matter more than the whole name."""
_DEFAULT_COLUMNS = 80
"""A terminal that does not say its width is taken to be this wide (as ``shutil.get_terminal_size`` does)."""


def _clock(seconds: float) -> str:
    s = round(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def format_bar(p: Progress, width: int = 28, room: int | None = None) -> str:
    """One line: ``save [#######-------]  45%  1.2 GiB/2.7 GiB  310.0 MiB/s  ETA 0:05  write  rank 3 at 20%``
    (the phase shows what a full bar still waits for: ``report``, ``commit``); the final record ends with
    ``done in m:ss`` or ``FAILED in <phase> in m:ss``. The bar is ``width`` characters between the
    brackets; the slowest rank appears when it lags (more than 10 points behind the whole).

    With ``room``, the line takes at most that many terminal columns: the bar shrinks (down to 10
    characters), then fields go, least telling first (slowest rank, phase, throughput, time left, sizes,
    the outcome's time; the operation, bar, percentage and outcome stay), then the operation's label is
    shortened in its middle (down to 12 columns: ``verify step-0...0123456``), then the tail is cut."""
    fields = _fields(p)
    label = p.op
    line = _join(p, label, width, fields)
    if room is None:
        return line
    over = columns(line) - room
    if over > 0 and width > _MIN_BAR:
        width = max(_MIN_BAR, width - over)
        line = _join(p, label, width, fields)
    for drop in sorted((f for f in fields if f[0] > 0), key=lambda f: -f[0]):
        if columns(line) <= room:
            break
        fields = [f for f in fields if f is not drop]
        line = _join(p, label, width, fields)
    keep = room - (columns(line) - columns(label))
    if columns(line) > room and keep >= _MIN_LABEL:
        line = _join(p, _middle(label, keep), width, fields)
    return cut(line, max(0, room))


def _middle(text: str, width: int) -> str:
    """``text`` in at most ``width`` columns: its start and its end (where a step number is), joined by
    ``...`` (plain ASCII: any terminal's encoding can write it)."""
    head = cut(text, (width - 3) // 2)
    tail = cut(text[::-1], width - 3 - columns(head))[::-1]
    return f"{head}...{tail}"


def _fields(p: Progress) -> list[tuple[int, str]]:
    """The line's fields after the percentage, in order, each with how readily it goes when space is
    short (0: never; the larger, the sooner). A field that starts with a space follows the one before
    it at one space (``FAILED in read`` ``in 0:05``) rather than two."""
    fields = [(2, f"{binary_size(p.done_bytes)}/{binary_size(p.total_bytes)}")]
    fields.append((4, f"{binary_size(p.bytes_per_second)}/s"))
    if p.finished:
        fields.append((0, f"FAILED in {p.phase}" if p.error else "done"))
        fields.append((1, f" in {_clock(p.seconds)}"))
        return fields
    eta = p.eta_seconds
    fields.append((3, f"ETA {_clock(eta)}" if eta is not None else "ETA --:--"))
    fields.append((5, p.phase))
    if p.ranks > 1 and p.slowest_fraction < p.fraction - 0.1:
        fields.append((6, f"rank {p.slowest_rank} at {100 * p.slowest_fraction:.0f}%"))
    return fields


def _join(p: Progress, label: str, width: int, fields: list[tuple[int, str]]) -> str:
    filled = int(p.fraction * width + 1e-9)
    line = f"{label} [{'#' * filled}{'-' * (width - filled)}] {100 * p.fraction:3.0f}%"
    for _, text in fields:
        line += text if text.startswith(" ") else "  " + text
    return line


class ProgressBar:
    """A ``progress=`` callback drawing :func:`format_bar` on ``stream`` (default ``sys.stderr`` at the
    time of each call). One instance may serve many operations in turn; each ends its own line."""

    def __init__(self, stream: TextIO | None = None, *, width: int = 28) -> None:
        if width < 1:
            raise InvalidArgumentError(f"width={width!r} must be at least 1")
        self.stream = stream
        self.width = width
        self._drawn = 0  # length of the line now on the terminal
        self._plain_started = False

    def __call__(self, p: Progress) -> None:
        if p.total_bytes == 0 and not p.finished:
            return  # nothing planned yet (a manifest being read, an export being planned): no "0 B of 0 B"
        out = self.stream if self.stream is not None else sys.stderr
        if _is_tty(out):
            room = _terminal_columns(out) - 1
            line = format_bar(p, self.width, room)
            pad = " " * max(0, min(self._drawn, room) - columns(line))  # over what is left of a longer line
            out.write("\r" + line + pad + ("\n" if p.finished else ""))
            self._drawn = 0 if p.finished else columns(line)
        else:
            if not p.finished or self._plain_started:
                out.write(f"shardsafe: {describe(p)}\n")
            self._plain_started = not p.finished
        out.flush()


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or file-like stream without a terminal
        return False


def _terminal_columns(stream: TextIO) -> int:
    """The width of the terminal behind ``stream``: ``COLUMNS`` when set (as ``shutil.get_terminal_size``
    reads it), else the terminal's own, else 80."""
    env = os.environ.get("COLUMNS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        size = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):  # a file-like stream without a descriptor, or closed
        return _DEFAULT_COLUMNS
    return size if size > 0 else _DEFAULT_COLUMNS  # a pseudo-terminal whose size was never set says 0


def command_bar(label: str | None = None) -> ProgressCallback:
    """The ``shardsafe`` commands' ``progress=``: a :class:`ProgressBar` on stderr, which draws a bar when
    stderr is a terminal (off one: plain lines, only for an operation that runs past the interval).
    ``label`` replaces the operation's name at the start of the bar (``verify step-100``); it and the
    record's path and error (a directory name may hold terminal escapes) are made one line of printable
    characters."""
    drawn = ProgressBar()
    shown = None if label is None else one_line(label)

    def safe(p: Progress) -> None:
        error = None if p.error is None else one_line(p.error)
        drawn(dataclasses.replace(p, op=shown or p.op, path=one_line(p.path), error=error))

    return safe
