"""The progress bar on a terminal fits the terminal's width: every redraw is one line narrower than the
terminal (a line as wide as the terminal, or wider, wraps, and the next ``\\r`` then redraws only its last
row, leaving a line behind at each redraw). Driven with a fake width (``COLUMNS``) and with a real
pseudo-terminal whose window size is set, at 120, 80, 40 and 12 columns. Off a terminal: plain lines,
never cut."""

from __future__ import annotations

import fcntl
import io
import os
import re
import struct
import termios
import unicodedata
from typing import Any

import pytest

from shardsafe import Progress, ProgressBar


class _Tty(io.StringIO):
    """A terminal of unknown size (no file descriptor): the width comes from ``COLUMNS``."""

    def isatty(self) -> bool:
        return True


def _record(**kw: Any) -> Progress:
    """A record whose full line is long: a long label, large figures and a lagging rank."""
    base: dict[str, Any] = dict(
        op="verify step-000123456",
        path="/ck",
        phase="write",
        done_bytes=512 * 2**30 + 12345,
        total_bytes=1023 * 2**30,
        seconds=4000.0,
        ranks=64,
        ranks_reporting=64,
        slowest_rank=63,
        slowest_fraction=0.125,
    )
    base.update(kw)
    return Progress(**base)


def _columns(text: str) -> int:
    """Terminal columns ``text`` takes (wide East Asian characters take two)."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def _drawn(text: str) -> list[str]:
    """The lines a terminal shows in turn: each ``\\r`` starts a redraw, ``\\n`` ends the last."""
    assert text.startswith("\r"), text
    return [part.rstrip("\n") for part in text.split("\r")[1:]]


def _drive(bar: ProgressBar) -> None:
    bar(_record(done_bytes=0, seconds=0.0))
    bar(_record())
    bar(_record(done_bytes=1023 * 2**30, slowest_fraction=1.0, finished=True, phase="done"))


@pytest.mark.parametrize("columns", [120, 80, 40, 12])
def test_every_redraw_fits_a_terminal_of_that_width(columns: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", str(columns))
    tty = _Tty()
    _drive(ProgressBar(tty))
    text = tty.getvalue()
    lines = _drawn(text)
    assert len(lines) == 3 and text.count("\n") == 1 and text.endswith("\n"), repr(text)
    for line in lines:
        assert _columns(line) <= columns - 1, (columns, line)
    # what goes is the middle of a long label, then the tail: the line starts with the operation and, from
    # 40 columns on, shows the percent and the outcome
    assert all(line.startswith("verify step-000123456"[: min(columns - 1, 6)]) for line in lines), lines
    if columns >= 40:
        assert re.search(r"\]\s+50%", lines[1]), lines[1]
        assert re.search(r"\]\s*100%.*\bdone\b", lines[2]), lines[2]
    if columns >= 120:  # room for everything: nothing cut
        assert lines[2].rstrip().endswith("done in 1:06:40") and "rank 63 at 12%" in lines[1], lines


@pytest.mark.parametrize("columns", [80, 60])
def test_the_outcome_of_a_finished_operation_stays_when_fields_go(
    columns: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Space goes first to the operation, the bar, the percentage and the outcome (``done``/``FAILED in
    <phase>``); the slowest rank, phase, throughput, time left, sizes and the outcome's time give way, in
    that order."""
    monkeypatch.setenv("COLUMNS", str(columns))
    tty = _Tty()
    bar = ProgressBar(tty)
    bar(_record())
    bar(_record(finished=True, error="CorruptCheckpointError: bad block", phase="read"))
    running, failed = _drawn(tty.getvalue())
    assert _columns(running) <= columns - 1 and _columns(failed) <= columns - 1
    assert re.search(r"\]\s+50%", running) and "rank 63" not in running, running  # the first field to go
    outcome = "FAILED in read in 1:06:40" if columns >= 80 else "FAILED in read"
    assert failed.rstrip().endswith(outcome), (columns, failed)
    out = _Tty()
    ProgressBar(out)(_record(done_bytes=1023 * 2**30, finished=True, phase="done"))
    (done,) = _drawn(out.getvalue())
    assert re.search(r"100%.*done( in 1:06:40)?\s*$", done) and _columns(done) <= columns - 1, done


def test_a_narrower_redraw_clears_the_longer_one_within_the_width(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    tty = _Tty()
    bar = ProgressBar(tty, width=10)
    bar(_record())  # long: cut to 79 columns
    bar(_record(op="save", done_bytes=2**20, total_bytes=2**30, seconds=2.0, ranks=1))  # short: padded to 79
    lines = _drawn(tty.getvalue())
    assert _columns(lines[0]) <= 79 and _columns(lines[1]) == _columns(lines[0]), lines
    assert lines[1].startswith("save [") and lines[1].endswith("  "), lines


def test_wide_characters_count_double(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "40")
    tty = _Tty()
    ProgressBar(tty)(_record(op="verify 检查点检查点检查点检查点"))
    (line,) = _drawn(tty.getvalue())
    assert _columns(line) <= 39, line


def _pty_with_width(columns: int) -> tuple[int, io.TextIOWrapper]:
    """A pseudo-terminal of ``columns`` x 24: the master's descriptor and the slave as a text stream."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    attrs = termios.tcgetattr(slave)
    attrs[1] &= ~termios.OPOST  # no output processing: "\n" stays "\n"
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    return master, io.TextIOWrapper(io.FileIO(slave, "w"), encoding="utf-8", write_through=True)


def _read_all(master: int) -> str:
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # the slave side is closed and drained
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks).decode("utf-8")


@pytest.mark.parametrize("columns", [80, 40])
def test_a_real_terminal_of_that_width(columns: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    master, stream = _pty_with_width(columns)
    try:
        _drive(ProgressBar(stream))
    finally:
        stream.close()
    text = _read_all(master)
    os.close(master)
    lines = _drawn(text)
    assert len(lines) == 3 and text.endswith("\n"), repr(text)
    for line in lines:
        assert _columns(line) <= columns - 1, (columns, line)


def test_the_terminal_is_asked_at_every_redraw(monkeypatch: pytest.MonkeyPatch) -> None:
    """A terminal made narrower while a long operation runs: the next redraw fits the new width."""
    tty = _Tty()
    bar = ProgressBar(tty)
    monkeypatch.setenv("COLUMNS", "120")
    bar(_record())
    monkeypatch.setenv("COLUMNS", "50")
    bar(_record(done_bytes=600 * 2**30))
    first, second = _drawn(tty.getvalue())
    assert _columns(first) > 80 and _columns(second) <= 49, (first, second)


def test_off_a_terminal_plain_lines_are_not_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "40")
    log = io.StringIO()
    _drive(ProgressBar(log))
    lines = log.getvalue().splitlines()
    assert len(lines) == 3 and "\r" not in log.getvalue() and "#" not in log.getvalue()
    assert all(line.startswith("shardsafe: verify step-000123456 of /ck") for line in lines), lines
    assert max(map(len, lines)) > 40


def test_a_long_label_is_shortened_before_the_bar_and_outcome_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """``shardsafe ls --verify`` labels each bar ``verify <name>``: with a long name at 80 columns the
    bar, the percentage and the outcome used to be cut away with the tail of the line."""
    monkeypatch.setenv("COLUMNS", "80")
    name = "verify " + "run-with-a-long-descriptive-name-lr3e-4-bs1024-seed17-" * 2 + "step-000123456"
    tty = _Tty()
    bar = ProgressBar(tty)
    bar(_record(op=name))
    bar(_record(op=name, done_bytes=1023 * 2**30, finished=True, phase="done"))
    running, done = _drawn(tty.getvalue())
    for line in (running, done):
        assert _columns(line) <= 79, line
        assert line.startswith("verify run-with") and "step-000123456 [" in line, line
    assert re.search(r"\]\s+50%", running), running
    assert re.search(r"\]\s*100%\s+done", done), done


def test_ls_verify_shows_the_bar_and_outcome_of_a_long_name_at_80_columns(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    import torch

    import shardsafe
    from shardsafe.cli import main

    name = "pretrain-llama-7b-lr3e-4-warmup2000-bs1024-seq4096-seed17-node32-step-000123456"
    shardsafe.save(tmp_path / name, {"w": torch.zeros(1000)})
    monkeypatch.setenv("COLUMNS", "80")
    tty = _Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    assert main(["ls", str(tmp_path), "--verify"]) == 0
    lines = _drawn(tty.getvalue())
    assert lines and all(_columns(line) <= 79 for line in lines), lines
    assert re.search(r"\]\s*100%\s+done", lines[-1]) and "step-000123456 [" in lines[-1], lines[-1]
    assert name in capsys.readouterr().out  # the table keeps the whole name
