"""Progress of verify and export (docs/progress.md), and the CLI's progress bars: records that never go
back and end exactly at what the operation verifies or writes (an incremental checkpoint's referenced
chunks once, in the base file where they are verified; ``part=`` only its files); a callback that
raises, a corrupt checkpoint, a callback that is not callable; a bar on a terminal's stderr for
``verify``, ``ls --verify`` and ``export`` with stdout byte for byte as off a terminal."""

from __future__ import annotations

import io
import json
import logging
import re
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe import Progress
from shardsafe.cli import main
from shardsafe.engine import inspect as inspect_module
from shardsafe.errors import CorruptCheckpointError
from shardsafe.interop.consolidate import consolidate
from shardsafe.interop.hf import export_hf
from shardsafe.interop.torchfile import export_torch


def _state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(64, 32, generator=g),
        "b": torch.randn(40, 10, generator=g).double(),
        "c": torch.arange(9),
        "d": torch.randn(16, generator=g),
        "step": 3,
    }


def _tensor_bytes(state: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


def _data_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.name.startswith("data-"))


def _header(file: Path) -> int:
    """Bytes of a safetensors file before its data: the length field and the header it gives."""
    with open(file, "rb") as f:
        return 8 + int(struct.unpack("<Q", f.read(8))[0])


def _series(records: list[Progress], op: str, path: str) -> Progress:
    """Monotone done bytes never past the total, exactly one final record and it is the last."""
    assert records, "the callback was never called"
    assert all(r.op == op and r.path == path for r in records), records
    dones = [r.done_bytes for r in records]
    assert dones == sorted(dones), dones
    assert all(r.done_bytes <= r.total_bytes for r in records), records
    assert [r.finished for r in records] == [False] * (len(records) - 1) + [True]
    return records[-1]


@pytest.fixture
def slow_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Verification long enough for several records: every chunk read takes 60 ms, reports every 20 ms."""
    monkeypatch.setenv("SHARDSAFE_PROGRESS_INTERVAL", "0.02")
    real = inspect_module.read_blocks

    def slow(*args: Any, **kwargs: Any) -> None:
        time.sleep(0.06)
        real(*args, **kwargs)

    monkeypatch.setattr(inspect_module, "read_blocks", slow)


# ------------------------------------------------------------------------------------------- verify


def test_verify_progress_of_a_plain_checkpoint(tmp_path: Path, slow_reads: None) -> None:
    path = str(tmp_path / "c")
    shardsafe.save(path, _state())
    records: list[Progress] = []
    summary = shardsafe.verify(path, progress=records.append)
    last = _series(records, "verify", path)
    assert len(records) >= 3  # four chunks of 60 ms, reported every 20 ms
    assert any(0 < r.done_bytes < r.total_bytes for r in records[:-1]), records
    assert last.phase == "done" and last.error is None and last.ranks == 1
    whole = sum(f.stat().st_size for f in _data_files(tmp_path / "c"))
    assert last.done_bytes == last.total_bytes == summary.bytes == whole


def test_verify_progress_of_an_incremental_checkpoint_and_its_parts(tmp_path: Path) -> None:
    state = _state()
    shardsafe.save(tmp_path / "s1", state)
    state["a"] = state["a"] + 1  # the rest is referenced in s1's data file
    shardsafe.save(tmp_path / "s2", state, base=tmp_path / "s1")
    (own,), (base,) = _data_files(tmp_path / "s2"), _data_files(tmp_path / "s1")
    path = str(tmp_path / "s2")

    records: list[Progress] = []
    summary = shardsafe.verify(path, progress=records.append)
    last = _series(records, "verify", path)
    # every tensor's bytes once (the referenced ones where they live), and the two headers read
    expected = _tensor_bytes(state) + _header(own) + _header(base)
    assert last.done_bytes == last.total_bytes == summary.bytes == expected
    assert expected < own.stat().st_size + base.stat().st_size  # s1's old "a" is not verified

    totals = []
    for i in range(2):
        part: list[Progress] = []
        got = shardsafe.verify(path, part=(i, 2), progress=part.append)
        end = _series(part, "verify", path)
        assert end.done_bytes == end.total_bytes == got.bytes > 0
        totals.append(end.total_bytes)
    assert totals == [own.stat().st_size, expected - own.stat().st_size]  # own file, then s1's referenced part


def test_raising_callback_does_not_stop_verification(
    tmp_path: Path, slow_reads: None, caplog: pytest.LogCaptureFixture
) -> None:
    path = str(tmp_path / "c")
    shardsafe.save(path, _state())
    calls: list[Progress] = []

    def broken(p: Progress) -> None:
        calls.append(p)
        raise RuntimeError("bar broke")

    with caplog.at_level(logging.INFO, logger="shardsafe.progress.tracker"):
        summary = shardsafe.verify(path, progress=broken)
    assert summary.bytes == sum(f.stat().st_size for f in _data_files(tmp_path / "c"))
    assert len(calls) == 1 and not calls[0].finished  # raised on the first record: never called again
    lines = [r.getMessage() for r in caplog.records if r.name == "shardsafe.progress.tracker"]
    assert any("progress callback of the verify" in m and "bar broke" in m for m in lines), lines
    assert "finished" in lines[-1] and "100%" in lines[-1], lines  # records went on being made


def test_corrupt_checkpoint_ends_with_an_error_record(tmp_path: Path) -> None:
    path = tmp_path / "c"
    shardsafe.save(path, _state())
    manifest = json.loads((path / "MANIFEST.json").read_text())
    chunk = manifest["tensors"]["d"]["chunks"][0]
    file = path / chunk["file"]
    raw = bytearray(file.read_bytes())
    raw[chunk["begin"] + 5] ^= 0x01
    file.write_bytes(bytes(raw))
    records: list[Progress] = []
    with pytest.raises(CorruptCheckpointError):
        shardsafe.verify(path, progress=records.append)
    last = _series(records, "verify", str(path))
    assert last.error is not None and last.error.startswith("CorruptCheckpointError") and "'d'" in last.error
    assert last.phase != "done" and last.done_bytes < last.total_bytes

    missing: list[Progress] = []
    with pytest.raises(shardsafe.CheckpointNotFoundError):
        shardsafe.verify(tmp_path / "nothing", progress=missing.append)
    assert _series(missing, "verify", str(tmp_path / "nothing")).error is not None


def test_progress_that_is_not_callable_is_refused_before_any_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shardsafe.save(tmp_path / "c", _state())

    def no_storage(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("storage was reached")

    monkeypatch.setattr(inspect_module, "get_storage", no_storage)
    with pytest.raises(TypeError, match="must be a callable"):
        shardsafe.verify(tmp_path / "c", progress="bar")  # type: ignore[arg-type]
    for export in (export_hf, export_torch, consolidate):
        with pytest.raises(TypeError, match="must be a callable"):
            export(tmp_path / "c", tmp_path / "out", progress=3)  # type: ignore[operator]
        assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------- export


def test_export_progress_ends_at_the_bytes_written(tmp_path: Path) -> None:
    state = _state()
    shardsafe.save(tmp_path / "s1", state)
    state["a"] = state["a"] * 2
    shardsafe.save(tmp_path / "s2", state, base=tmp_path / "s1")
    src = str(tmp_path / "s2")
    for name, run in (
        ("hf", lambda cb: export_hf(src, tmp_path / "hf", key="/", max_shard_size=3000, progress=cb)),
        ("torch", lambda cb: export_torch(src, tmp_path / "t.pt", key="/", progress=cb)),
        ("shardsafe", lambda cb: consolidate(src, tmp_path / "copy", progress=cb)),
    ):
        records: list[Progress] = []
        result = run(records.append)
        last = _series(records, "export", src)
        assert last.phase == "done" and last.error is None, name
        assert last.done_bytes == last.total_bytes == result.bytes > 0, (name, last, result)
    assert shardsafe.verify(tmp_path / "copy").bytes == sum(f.stat().st_size for f in _data_files(tmp_path / "copy"))


# ---------------------------------------------------------------------------------------------- CLI


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


_BAR_END = re.compile(r"100%.* done in \d+:\d\d *\n$")


def _run(argv: list[str], stderr: io.StringIO, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> tuple[int, str]:
    monkeypatch.setattr("sys.stderr", stderr)
    code = main(argv)
    return code, capsys.readouterr().out


def test_cli_draws_bars_on_a_terminal_and_keeps_stdout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    shardsafe.save(tmp_path / "root" / "step-1", _state())
    shardsafe.save(tmp_path / "root" / "step-2", _state(1), base=tmp_path / "root" / "step-1")
    ckpt = str(tmp_path / "root" / "step-2")
    commands = [
        (["verify", ckpt], "verify"),
        (["ls", str(tmp_path / "root"), "--verify"], "verify step-1"),
        (["export", ckpt, "{out}", "--key", "/"], "export"),
        (["export", ckpt, "{out}", "--key", "/", "--format", "torch"], "export"),
        (["export", ckpt, "{out}", "--format", "shardsafe"], "export"),
    ]
    for i, (argv, label) in enumerate(commands):
        plain, tty = io.StringIO(), _Tty()
        first = [a.replace("{out}", str(tmp_path / f"plain{i}")) for a in argv]
        second = [a.replace("{out}", str(tmp_path / f"tty{i}")) for a in argv]
        code, out = _run(first, plain, monkeypatch, capsys)
        assert code == 0 and plain.getvalue() == "", (argv, plain.getvalue())  # quick: nothing off a terminal
        code, tty_out = _run(second, tty, monkeypatch, capsys)
        assert code == 0 and tty_out == out.replace(f"plain{i}", f"tty{i}"), (argv, out, tty_out)
        text = tty.getvalue()
        assert text.startswith(f"\r{label} [") and _BAR_END.search(text), (argv, text)
        assert text.count("\n") == (2 if argv[0] == "ls" else 1), (argv, text)  # one bar per checkpoint
        assert argv[0] != "ls" or "\rverify step-2 [" in text, text


def test_cli_bar_of_a_corrupt_checkpoint_and_a_hostile_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], slow_reads: None
) -> None:
    root = tmp_path / "root"
    shardsafe.save(root / "step-\x1b[2J", _state())
    file = _data_files(root / "step-\x1b[2J")[0]
    raw = bytearray(file.read_bytes())
    raw[-1] ^= 0x01
    file.write_bytes(bytes(raw))
    plain = io.StringIO()
    code, out = _run(["ls", str(root), "--verify"], plain, monkeypatch, capsys)
    lines = plain.getvalue().splitlines()  # off a terminal, past the interval: plain lines
    assert code == 1 and len(lines) >= 2 and "\x1b" not in plain.getvalue(), lines
    assert lines[0].startswith("shardsafe: verify step-\\x1b[2J of ") and "\\x1b[2J: phase read" in lines[0]
    assert "FAILED: CorruptCheckpointError" in lines[-1]
    tty = _Tty()
    code, out = _run(["ls", str(root), "--verify"], tty, monkeypatch, capsys)
    assert code == 1 and "corrupt" in out
    text = tty.getvalue()
    assert "\x1b" not in text and text.startswith("\rverify step-\\x1b[2J [") and "FAILED in read" in text, text

    tty = _Tty()
    code, out = _run(["verify", str(root / "step-\x1b[2J")], tty, monkeypatch, capsys)
    lines = tty.getvalue().split("\n")
    assert code == 1 and out == "" and "FAILED in read" in lines[0] and lines[1].startswith("shardsafe verify: CORRUPT")
