"""Progress reporting of save, async_save and load (docs/progress.md): records that never go back, end
exactly at the bytes of the data files (save) or of what the ranks read (load), on one process and on
two; INFO lines past the interval; callbacks that raise, block or are passed on another rank; the
progress bar's formatting."""

from __future__ import annotations

import io
import logging
import os
import re
import threading
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe import Progress, ProgressBar
from shardsafe.progress.bar import format_bar

from harness import check_ok, run_ranks

FAST = {"SHARDSAFE_PROGRESS_INTERVAL": "0.05"}


def _data_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.startswith("data-"))


def _check_series(records: list[Progress], op: str, path: str) -> Progress:
    """Monotone done bytes, exactly one final record and it is the last; returns it."""
    assert records, "the callback was never called"
    assert all(r.op == op and r.path == path for r in records)
    dones = [r.done_bytes for r in records]
    assert dones == sorted(dones), dones
    assert all(r.done_bytes <= r.total_bytes for r in records), records
    assert [r.finished for r in records] == [False] * (len(records) - 1) + [True]
    return records[-1]


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(512, 256, generator=g),
        "v": torch.randn(300, 100, generator=g).double(),
        "i": torch.arange(7),
        "step": 5,
    }


def _zeros(state: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}


def _tensor_bytes(state: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


def test_save_and_load_progress_in_one_process(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDSAFE_PROGRESS_INTERVAL", "0.05")
    monkeypatch.setenv("SHARDSAFE_FAULT", "save.write:rank=0:sleep=0.6,load.read:rank=0:sleep=0.6")
    path = str(tmp_path / "c")
    state = _state()
    saved: list[Progress] = []
    shardsafe.save(path, state, progress=saved.append)
    last = _check_series(saved, "save", path)
    assert len(saved) >= 3  # the write took 12 intervals (a loaded machine may deliver few of them)
    assert last.phase == "done" and last.error is None and last.ranks == 1
    assert last.done_bytes == last.total_bytes == _data_bytes(path)
    assert last.fraction == 1.0 and last.slowest_fraction == 1.0
    assert any(r.phase == "write" and r.done_bytes < r.total_bytes for r in saved[:-1])

    loaded: list[Progress] = []
    dest = _zeros(state)
    shardsafe.load(path, dest, progress=loaded.append)
    last = _check_series(loaded, "load", path)
    assert len(loaded) >= 3
    assert last.done_bytes == last.total_bytes == _tensor_bytes(state)
    assert torch.equal(dest["w"], state["w"]) and dest["step"] == 5

    whole: list[Progress] = []
    shardsafe.load(path, progress=whole.append)  # state=None: one process reads everything
    assert _check_series(whole, "load", path).done_bytes == _tensor_bytes(state)


def test_info_line_past_the_interval(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    monkeypatch.setenv("SHARDSAFE_PROGRESS_INTERVAL", "0.05")
    monkeypatch.setenv("SHARDSAFE_FAULT", "save.write:rank=0:sleep=0.3")
    path = str(tmp_path / "c")
    with caplog.at_level(logging.INFO, logger="shardsafe.progress.tracker"):
        shardsafe.save(path, _state())  # no callback: the INFO lines come anyway
    lines = [r.getMessage() for r in caplog.records if r.name == "shardsafe.progress.tracker"]
    running = [m for m in lines if "phase write" in m]
    assert running and all(f"save of {path}" in m and "/s" in m and "left" in m for m in running), lines
    assert "finished" in lines[-1] and "100%" in lines[-1], lines


def test_quick_save_logs_no_progress_line(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    monkeypatch.setenv("SHARDSAFE_PROGRESS_INTERVAL", "60")
    with caplog.at_level(logging.INFO, logger="shardsafe.progress.tracker"):
        shardsafe.save(str(tmp_path / "c"), {"x": torch.ones(4)})  # far under the interval
    assert not [r for r in caplog.records if r.name == "shardsafe.progress.tracker"]


def test_raising_callback_is_logged_and_the_save_commits(tmp_path: Any, caplog: Any) -> None:
    calls: list[Progress] = []

    def broken(p: Progress) -> None:
        calls.append(p)
        raise ValueError("bar broke")

    path = str(tmp_path / "c")
    with caplog.at_level(logging.ERROR, logger="shardsafe.progress.tracker"):
        shardsafe.save(path, _state(), progress=broken)
    assert len(calls) == 1  # not called again once it raised
    shardsafe.verify(path)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert errors and "progress callback of the save" in errors[0].getMessage()
    assert "bar broke" in errors[0].getMessage() and errors[0].exc_info is not None


def test_blocked_callback_does_not_hold_the_save(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    monkeypatch.setenv("SHARDSAFE_PROGRESS_INTERVAL", "0.05")
    monkeypatch.setenv("SHARDSAFE_PROGRESS_FINAL_WAIT", "0.2")
    monkeypatch.setenv("SHARDSAFE_FAULT", "save.write:rank=0:sleep=0.3")
    release = threading.Event()
    seen: list[Progress] = []

    def blocked(p: Progress) -> None:
        seen.append(p)
        assert release.wait(60)

    path = str(tmp_path / "c")
    with caplog.at_level(logging.WARNING, logger="shardsafe.progress.tracker"):
        shardsafe.save(path, _state(), progress=blocked)  # returns although the callback never does
    shardsafe.verify(path)
    assert len(seen) == 1 and not seen[0].finished
    assert any("has not taken the final record" in r.getMessage() for r in caplog.records)
    release.set()
    for _ in range(200):  # the final record still arrives, from the callback's own thread
        if seen[-1].finished:
            break
        threading.Event().wait(0.05)
    assert seen[-1].finished and seen[-1].done_bytes == _data_bytes(path)
    assert len(seen) == 2  # records that came while it was blocked were replaced by newer ones


def test_failed_save_ends_with_an_error_record(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDSAFE_FAULT", "save.write:rank=0:raise")
    records: list[Progress] = []
    with pytest.raises(shardsafe.CheckpointError):
        shardsafe.save(str(tmp_path / "c"), _state(), progress=records.append)
    assert len(records) == 1 and records[0].finished
    assert records[0].phase == "write" and "injected fault" in (records[0].error or "")


def test_async_save_reports_from_a_background_thread(tmp_path: Any) -> None:
    threads: list[str] = []
    records: list[Progress] = []

    def note(p: Progress) -> None:
        threads.append(threading.current_thread().name)
        records.append(p)

    path = str(tmp_path / "c")
    handle = shardsafe.async_save(path, _state(), progress=note)
    handle.wait()
    last = _check_series(records, "save", path)
    assert last.done_bytes == last.total_bytes == _data_bytes(path)
    assert threading.current_thread().name not in threads


def test_zero_bytes_and_bad_callbacks(tmp_path: Any) -> None:
    records: list[Progress] = []
    path = str(tmp_path / "c")
    shardsafe.save(path, {"step": 3, "name": "x"}, progress=records.append)
    assert len(records) == 1 and records[0].finished
    assert records[0].done_bytes == records[0].total_bytes == 0 and records[0].fraction == 1.0
    with pytest.raises(TypeError, match="progress="):
        shardsafe.save(str(tmp_path / "d"), {"x": 1}, progress="bar")  # type: ignore[arg-type]
    assert not (tmp_path / "d").exists()
    with pytest.raises(TypeError, match="progress="):
        shardsafe.load(path, {"step": 0}, progress=42)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------- two ranks


def _two_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    state = _state()
    out: dict[str, Any] = {}
    for name in ("save", "load", "async"):
        records: list[Progress] = []
        path = os.path.join(root, "a" if name == "async" else "s")
        if name == "save":
            shardsafe.save(path, state, progress=records.append)
        elif name == "load":
            dest = _zeros(state)
            shardsafe.load(path, dest, progress=records.append)
            assert torch.equal(dest["w"], state["w"]) and torch.equal(dest["v"], state["v"])
        else:
            shardsafe.async_save(path, state, progress=records.append).wait()
        out[name] = records
    if rank == 0:  # the keys of the two finished operations are gone; the last one's stay until the next
        import torch.distributed as dist

        from shardsafe.coord.client import client_for
        from shardsafe.deadline import Deadline

        client = client_for(dist.distributed_c10d._get_default_store(), id(dist.group.WORLD))  # shardsafe's own
        key = "shardsafe/g0-1/ckpt/{}/counters/progress/{}".format
        soon = Deadline.after(10, "test")
        out["keys"] = [[client.check([key(seq, r)], soon) for r in range(world)] for seq in (1, 2, 3)]
    return out


def test_two_ranks_save_load_and_async_save(tmp_path: Any) -> None:
    env = {**FAST, "SHARDSAFE_FAULT": "save.write:rank=1:sleep=0.3,load.read:rank=1:sleep=0.3"}
    results = check_ok(run_ranks(_two_ranks, 2, str(tmp_path), timeout=120, env=env))
    assert results[1] == {"save": [], "load": [], "async": []}  # a callback on rank 1 is not called
    r0 = results[0]
    assert r0["keys"] == [[False, False], [False, False], [True, True]]
    save = _check_series(r0["save"], "save", str(tmp_path / "s"))
    assert save.ranks == 2 and save.ranks_reporting == 2
    assert save.done_bytes == save.total_bytes == _data_bytes(str(tmp_path / "s"))
    assert len([f for f in os.listdir(tmp_path / "s") if f.startswith("data-")]) == 2  # both ranks wrote
    assert len(r0["save"]) >= 3  # rank 1's write took 6 intervals: rank 0 reported meanwhile
    load = _check_series(r0["load"], "load", str(tmp_path / "s"))
    assert load.done_bytes == load.total_bytes == 2 * _tensor_bytes(_state())  # each rank reads the whole state
    assert len(r0["load"]) >= 3
    asave = _check_series(r0["async"], "save", str(tmp_path / "a"))
    assert asave.done_bytes == asave.total_bytes == _data_bytes(str(tmp_path / "a"))

    # reshard: the two ranks' checkpoint into one process
    records: list[Progress] = []
    dest = _zeros(_state())
    shardsafe.load(str(tmp_path / "s"), dest, progress=records.append)
    one = _check_series(records, "load", str(tmp_path / "s"))
    assert one.ranks == 1 and one.done_bytes == one.total_bytes == _tensor_bytes(_state())


def _save_and_die(rank: int, world: int, path: str) -> tuple[str, list[Progress]]:
    records: list[Progress] = []
    try:
        shardsafe.save(path, _state(), progress=records.append, timeout=60)
    except Exception as err:
        return type(err).__name__, records
    return "none", records


def test_rank_dying_mid_save_is_still_detected(tmp_path: Any) -> None:
    path = str(tmp_path / "c")
    env = {**FAST, "SHARDSAFE_DEAD_AFTER": "3", "SHARDSAFE_FAULT": "save.write:rank=1:kill"}
    out = run_ranks(_save_and_die, 2, path, timeout=90, env=env)
    assert out[1].exitcode == -9
    assert out[0].result is not None, out[0]
    kind, records = out[0].result
    assert kind == "RankDeadError"
    last = _check_series(records, "save", path)
    assert last.error is not None and "RankDeadError" in last.error
    assert not os.path.exists(os.path.join(path, "MANIFEST.json"))


# ----------------------------------------------------------------------------------- the bar


def _record(**kw: Any) -> Progress:
    base: dict[str, Any] = dict(
        op="save",
        path="/ck",
        phase="write",
        done_bytes=512 * 2**20,
        total_bytes=2**30,
        seconds=2.0,
        ranks=4,
        ranks_reporting=4,
        slowest_rank=3,
        slowest_fraction=0.125,
    )
    base.update(kw)
    return Progress(**base)


def test_format_bar() -> None:
    line = format_bar(_record(), width=20)
    assert line.startswith("save [##########----------]  50%")
    assert "512.0 MiB/1.0 GiB" in line and "256.0 MiB/s" in line and "ETA 0:02  write" in line
    assert "rank 3 at 12%" in line  # lagging far behind the whole
    assert "rank 3" not in format_bar(_record(slowest_fraction=0.45), width=20)
    done = format_bar(_record(done_bytes=2**30, slowest_fraction=1.0, finished=True, phase="done"), width=4)
    assert done.startswith("save [####] 100%") and done.endswith("done in 0:02")
    failed = format_bar(_record(finished=True, error="OSError: disk full"), width=4)
    assert "FAILED in write" in failed
    assert "ETA --:--" in format_bar(_record(done_bytes=0, seconds=0.0))
    assert "[####] 100%" in format_bar(_record(done_bytes=0, total_bytes=0, finished=True), width=4)
    assert format_bar(_record(seconds=4000.0, done_bytes=1, total_bytes=2**30)).count(":") >= 2  # h:mm:ss


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal_and_off() -> None:
    tty = _Tty()
    bar = ProgressBar(tty, width=10)
    bar(_record())
    bar(_record(done_bytes=2**30, finished=True, phase="done", slowest_fraction=1.0))
    text = tty.getvalue()
    assert text.startswith("\rsave [#####-----]") and text.count("\r") == 2 and text.endswith("\n")
    assert text.count("\n") == 1

    plain = io.StringIO()
    quiet = ProgressBar(plain)
    quiet(_record(done_bytes=2**30, finished=True, phase="done"))  # a quick operation: nothing off a terminal
    assert plain.getvalue() == ""
    quiet(_record())
    quiet(_record(done_bytes=2**30, finished=True, phase="done"))
    lines = plain.getvalue().splitlines()
    assert len(lines) == 2 and "\r" not in plain.getvalue() and "#" not in plain.getvalue()
    assert "phase write" in lines[0] and "finished" in lines[1]
    with pytest.raises(ValueError):
        ProgressBar(width=0)


def test_cli_import_draws_the_bar_on_a_terminal(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from shardsafe.cli import main

    src = tmp_path / "model.pt"
    torch.save({"w": torch.randn(256, 256), "b": torch.zeros(3)}, src)
    monkeypatch.setenv("SHARDSAFE_PROGRESS_INTERVAL", "0.05")
    monkeypatch.setenv("SHARDSAFE_FAULT", "save.write:rank=0:sleep=0.3")
    tty = _Tty()
    monkeypatch.setattr("sys.stderr", tty)
    assert main(["import", str(src), str(tmp_path / "c")]) == 0
    text = tty.getvalue()
    assert text.startswith("\rsave [") and re.search(r"100%.* done in \d+:\d\d *\n$", text), text

    plain = io.StringIO()
    monkeypatch.setattr("sys.stderr", plain)
    monkeypatch.delenv("SHARDSAFE_FAULT")
    monkeypatch.setenv("SHARDSAFE_PROGRESS_INTERVAL", "60")
    assert main(["import", str(src), str(tmp_path / "d")]) == 0
    assert plain.getvalue() == ""  # a quick import off a terminal says nothing on stderr
