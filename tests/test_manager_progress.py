"""``CheckpointManager(progress=)`` and ``progress=`` on its save, maybe_save and resume (docs/progress.md,
docs/manager.md): the records reach rank 0's callback, never go back, end at the bytes written or read;
a callback given to a call replaces the manager's for that call; one that raises loses no checkpoint."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe import CheckpointManager, Progress
from test_progress import FAST, _check_series, _data_bytes, _state, _tensor_bytes, _zeros

from harness import check_ok, run_ranks


def _name(step: int) -> str:
    return f"step-{step:08d}"


def _by_path(records: list[Progress]) -> dict[str, list[Progress]]:
    out: dict[str, list[Progress]] = {}
    for r in records:
        out.setdefault(r.path, []).append(r)
    return out


def _manager_saves_and_resumes(rank: int, world: int, root: str) -> dict[str, Any]:
    state = _state()
    default: list[Progress] = []
    per_call: list[Progress] = []
    broken_calls: list[Progress] = []
    background: list[Progress] = []
    resumed: list[Progress] = []

    def broken(p: Progress) -> None:
        broken_calls.append(p)
        raise ValueError("bar broke")

    opts: dict[str, Any] = {"keep_last": None, "save_on_signals": (), "timeout": 60}
    with CheckpointManager(root, every_n_steps=2, progress=default.append, **opts) as mgr:
        mgr.save(1, state)  # the manager's callback
        assert mgr.maybe_save(2, state)  # a scheduled save reports to it too
        mgr.save(3, state, progress=per_call.append)  # a call's own callback replaces it
        mgr.save(4, state, progress=broken)  # raises at its first record: logged, the save commits
    with CheckpointManager(root, async_save=True, progress=background.append, **opts) as mgr:
        mgr.save(5, state)
        mgr.wait()
    dest = _zeros(state)
    with CheckpointManager(root, **opts) as mgr:
        assert mgr.resume(dest, progress=resumed.append) == 5
    assert torch.equal(dest["w"], state["w"]) and torch.equal(dest["v"], state["v"])
    return {
        "default": default,
        "per_call": per_call,
        "broken": len(broken_calls),
        "background": background,
        "resumed": resumed,
    }


def test_manager_progress_on_two_ranks(tmp_path: Path) -> None:
    env = {**FAST, "SHARDSAFE_FAULT": "save.write:rank=1:sleep=0.3,load.read:rank=1:sleep=0.3"}
    r0, r1 = check_ok(run_ranks(_manager_saves_and_resumes, 2, str(tmp_path), timeout=120, env=env))
    assert r1 == {"default": [], "per_call": [], "broken": 0, "background": [], "resumed": []}  # rank 0 reports

    def path(step: int) -> str:
        return str(tmp_path / _name(step))

    default = _by_path(r0["default"])
    assert sorted(default) == [path(1), path(2)]  # not 3 and 4: their calls gave their own callbacks
    for step, records in [(1, default[path(1)]), (2, default[path(2)]), (3, r0["per_call"]), (5, r0["background"])]:
        last = _check_series(records, "save", path(step))
        assert last.phase == "done" and last.error is None and last.ranks == last.ranks_reporting == 2
        assert last.done_bytes == last.total_bytes == _data_bytes(path(step)), step
        assert len(records) >= 3, step  # rank 1's write took 6 intervals: rank 0 reported meanwhile
    assert r0["broken"] == 1  # not called again once it raised
    shardsafe.verify(path(4))
    assert len([f for f in os.listdir(path(4)) if f.startswith("data-")]) == 2

    last = _check_series(r0["resumed"], "load", path(5))
    assert last.phase == "done" and last.error is None
    assert last.done_bytes == last.total_bytes == 2 * _tensor_bytes(_state())  # each rank reads the whole state


def test_progress_that_is_not_callable_is_refused_before_anything_happens(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="progress="):
        CheckpointManager(tmp_path, save_on_signals=(), progress="bar")  # type: ignore[arg-type]
    with CheckpointManager(tmp_path, every_n_steps=1, save_on_signals=()) as mgr:
        with pytest.raises(TypeError, match="progress="):
            mgr.save(1, _state(), progress=42)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="progress="):
            mgr.maybe_save(1, _state(), progress=42)  # type: ignore[arg-type]
        assert list(tmp_path.iterdir()) == []
        with pytest.raises(TypeError, match="progress="):
            mgr.resume(_zeros(_state()), progress=42)  # type: ignore[arg-type]


def test_resume_reports_each_checkpoint_it_tries(tmp_path: Path) -> None:
    state = _state()
    with CheckpointManager(tmp_path, keep_last=None, save_on_signals=()) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
    (data,) = (tmp_path / _name(2)).glob("data-*.safetensors")
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF  # the newest is damaged in its last tensor's bytes
    data.write_bytes(bytes(raw))
    records: list[Progress] = []
    dest = _zeros(state)
    with CheckpointManager(tmp_path, save_on_signals=(), progress=records.append) as mgr:
        assert mgr.resume(dest) == 1
    tried = _by_path(records)
    assert list(tried) == [str(tmp_path / _name(2)), str(tmp_path / _name(1))]
    failed = _check_series(tried[str(tmp_path / _name(2))], "load", str(tmp_path / _name(2)))
    assert failed.error is not None and "CorruptCheckpointError" in failed.error
    last = _check_series(tried[str(tmp_path / _name(1))], "load", str(tmp_path / _name(1)))
    assert last.error is None and last.done_bytes == last.total_bytes == _tensor_bytes(state)
