"""``CheckpointManager(incremental=True)``: each save refers to the newest checkpoint for unchanged
data, retention never makes a kept checkpoint unloadable, storage stays near one full copy plus the
deltas, and a crash in the middle of an incremental save leaves the previous checkpoints loadable."""

from __future__ import annotations

import io
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.cli.ls import ls_main
from shardsafe.format.manifest import seal_manifest
from shardsafe.manager import CheckpointManager
from test_incremental import disk_bytes, frozen_state, manifest, step

from harness import check_ok, run_ranks


def expected(at: int, **kw: Any) -> dict[str, Any]:
    """The state ``frozen_state(**kw)`` reaches at manager step ``at`` (saved after ``at - 1`` steps)."""
    state = frozen_state(**kw)
    for _ in range(at - 1):
        step(state)
    return state


def assert_holds(path: str | Path, state: dict[str, Any]) -> None:
    shardsafe.verify(path)
    out = shardsafe.load(path)
    for k, v in state.items():
        assert torch.equal(out[k], v) if isinstance(v, torch.Tensor) else out[k] == v, (path, k)


def _two_ranks(rank: int, world: int, root: str) -> int:
    state = frozen_state(rows=256)
    full = 0
    with CheckpointManager(root, keep_last=2, incremental=True, save_on_signals=(), timeout=60) as mgr:
        for s in range(1, 5):
            mgr.save(s, state)
            if s == 1:
                full = disk_bytes(Path(root))
            step(state)
    return full


def test_keep_last_2_over_4_incremental_saves_on_2_ranks_stays_loadable_and_small(tmp_path: Path) -> None:
    # large tensors are split into row ranges between the 2 ranks (so a 1-process save boxes them otherwise)
    env = {"SHARDSAFE_SPLIT_REPLICATED_BYTES": str(64 * 1024)}
    full, _ = check_ok(run_ranks(_two_ranks, 2, str(tmp_path), timeout=120, env=env))
    with CheckpointManager(tmp_path, keep_last=2, save_on_signals=()) as mgr:
        kept = mgr.list()
    assert [r.step for r in kept] == [3, 4]
    for r in kept:
        assert_holds(r.path, expected(r.step or 0, rows=256))
    assert shardsafe.inspect(kept[-1].path).bases  # it is incremental indeed
    assert disk_bytes(tmp_path) < 1.35 * full, (disk_bytes(tmp_path), full)
    listing = {p.name for p in tmp_path.iterdir()}
    assert "step-00000002" not in listing  # nothing refers to it: gone entirely

    # a base saved by another world size: no box matches, everything is written, and it loads equal
    state = expected(4, rows=256)
    shardsafe.save(tmp_path / "one-rank", state, base=kept[-1].path)
    assert shardsafe.inspect(tmp_path / "one-rank").bases == []
    assert_holds(tmp_path / "one-rank", state)


def test_full_save_every_n_releases_the_old_base(tmp_path: Path) -> None:
    state = frozen_state(frozen=3, trained=1)
    with CheckpointManager(
        tmp_path, keep_last=1, incremental=True, full_save_every=2, leftover_age=0, save_on_signals=()
    ) as mgr:
        for s in range(1, 5):
            mgr.save(s, state)
            step(state)
        names = [r.name for r in mgr.list()]
    assert names == ["step-00000004"]
    assert shardsafe.inspect(tmp_path / "step-00000004").bases == ["step-00000003"]  # 3 was a full save
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003", "step-00000004"]  # 1 and 2 gone
    assert_holds(tmp_path / "step-00000004", expected(4, frozen=3, trained=1))
    out = io.StringIO()
    assert ls_main(str(tmp_path), verify=True, as_json=False, out=out) == 0  # a retired base is no fault
    lines = out.getvalue().splitlines()
    assert any(line.startswith("step-00000003") and " retired " in line for line in lines), lines
    assert any(line.startswith("step-00000004") and " committed " in line for line in lines), lines


def _crash(rank: int, world: int, root: str, point: str) -> None:
    state = frozen_state(frozen=3, trained=1)
    mgr = CheckpointManager(root, keep_last=2, incremental=True, save_on_signals=(), timeout=10)
    for s in (1, 2, 3):
        mgr.save(s, state)
        step(state)
    os.environ["SHARDSAFE_FAULT"] = f"{point}:rank=0:exit"  # dies like kill -9, no cleanup
    mgr.save(4, state)


@pytest.mark.parametrize("point", ["save.write", "save.publish", "save.confirm"])
def test_a_crash_during_an_incremental_save_leaves_the_previous_checkpoints_loadable(
    tmp_path: Path, point: str
) -> None:
    (outcome,) = run_ranks(_crash, 1, str(tmp_path), point, timeout=120)
    assert outcome.exitcode == 13
    with CheckpointManager(tmp_path, keep_last=2, incremental=True, leftover_age=0, save_on_signals=()) as mgr:
        kept = mgr.list()
        assert [r.step for r in kept] == ([2, 3, 4] if point == "save.confirm" else [2, 3])  # no retention yet
        for r in kept:
            assert_holds(r.path, expected(r.step or 0, frozen=3, trained=1))
        state = frozen_state(frozen=3, trained=1)
        resumed = mgr.resume(state)
        assert resumed == kept[-1].step
        for s in (resumed + 1, resumed + 2):  # go on: retention and leftover cleanup run after each
            step(state)
            mgr.save(s, state)
        for r in mgr.list():
            assert_holds(r.path, expected(r.step or 0, frozen=3, trained=1))


# ---------------------------------------------------------------------- full_save_every over restarts


def _saves_of(root: Path, steps: range, state: dict[str, Any], every: int = 3, **kw: Any) -> list[int]:
    """Save ``steps`` as a preemptible job does: a new manager (a restart) resumes, trains one step
    and saves. Returns the steps whose checkpoint came out full (no references)."""
    full = []
    for s in steps:
        with CheckpointManager(
            root, incremental=True, full_save_every=every, leftover_age=0, save_on_signals=(), **kw
        ) as mgr:
            if mgr.resume(state) is not None:
                step(state)  # train from the step resumed
            mgr.save(s, state)
        if not shardsafe.inspect(root / f"step-{s:08d}").bases:
            full.append(s)
    return full


def test_full_save_every_counts_across_restarts(tmp_path: Path) -> None:
    state = frozen_state(frozen=3, trained=1)
    # keep_last=1: the base of each incremental save but the first after a full one is retired (a tombstone)
    assert _saves_of(tmp_path, range(1, 8), state, keep_last=1) == [1, 4, 7]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000007"]  # the full save released the rest
    assert_holds(tmp_path / "step-00000007", expected(7, frozen=3, trained=1))


def _reseal(path: Path, edit: Any) -> None:
    doc = manifest(path)
    edit(doc)
    (path / "MANIFEST.json").write_text(json.dumps(seal_manifest(doc)))


def _set_count(doc: dict[str, Any], value: Any) -> None:
    items = [kv for kv in doc["metadata"]["items"] if kv[0] != "saves_since_full"]
    doc["metadata"]["items"] = items if value is _ABSENT else [*items, ["saves_since_full", value]]


_ABSENT = object()


def test_a_reference_cycle_makes_the_next_save_full(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state = frozen_state(frozen=3, trained=1)
    assert _saves_of(tmp_path, range(1, 4), state, every=10) == [1]
    one, three = tmp_path / "step-00000001", tmp_path / "step-00000003"
    assert sorted(manifest(three)["refs"]) == ["step-00000001"]

    def refer_to_three(doc: dict[str, Any]) -> None:  # 1 now also takes a tensor from 3: 1 -> 3 -> 1
        _add_reference(doc, three, "train0")
        _set_count(doc, 1)  # looks consistent: fewer saves since a full one than 3's two

    _reseal(one, refer_to_three)
    shardsafe.verify(one)  # a valid checkpoint, only circular
    with caplog.at_level(logging.WARNING, logger="shardsafe.manager"):
        assert _saves_of(tmp_path, range(4, 5), state, every=10) == [4]
    assert any("step-00000001" in r.getMessage() and "full" in r.getMessage() for r in caplog.records), caplog.text
    assert_holds(tmp_path / "step-00000004", expected(4, frozen=3, trained=1))


def _garbage(doc: dict[str, Any]) -> None:
    doc["refs"] = {"..": {"save_id": "x", "files": {}}}


@pytest.mark.parametrize(
    "damage",
    [
        "base not json",
        "base refs garbage",
        "base manifest gone",
        "count missing",
        "count not int",
        "count negative",
        "count huge",
        "count zero with references",
    ],
)
def test_a_chain_that_cannot_be_followed_makes_the_next_save_full(tmp_path: Path, damage: str) -> None:
    state = frozen_state(frozen=3, trained=1)
    assert _saves_of(tmp_path, range(1, 4), state, every=10) == [1]
    base, newest = tmp_path / "step-00000001", tmp_path / "step-00000003"
    if damage == "base not json":
        (base / "MANIFEST.json").write_bytes(b'{"format_version": 2, "refs": {')
    elif damage == "base refs garbage":
        _reseal(base, _garbage)
    elif damage == "base manifest gone":
        (base / "MANIFEST.json").unlink()
    else:
        value = {
            "count missing": _ABSENT,
            "count not int": "1",
            "count negative": -1,
            "count huge": 10**30,
            "count zero with references": 0,
        }[damage]
        _reseal(newest, lambda doc: _set_count(doc, value))
    shardsafe.verify(newest)  # the newest checkpoint itself still loads
    assert _saves_of(tmp_path, range(4, 6), state, every=10) == [4]  # full, then incremental again on it
    for s in (4, 5):
        assert_holds(tmp_path / f"step-{s:08d}", expected(s, frozen=3, trained=1))


def _add_reference(doc: dict[str, Any], to: Path, tensor: str) -> None:
    """Make ``doc`` also take ``tensor``, as ``extra``, from the checkpoint ``to`` (which holds it itself)."""
    theirs = manifest(to)
    entry = theirs["tensors"][tensor]
    (chunk,) = entry["chunks"]
    assert chunk["ref"] is None
    doc["tensors"]["extra"] = {**entry, "chunks": [{**chunk, "ref": to.name}]}
    doc["refs"][to.name] = {"save_id": theirs["save_id"], "files": {chunk["file"]: theirs["files"][chunk["file"]]}}


def test_more_references_than_saves_since_a_full_one_makes_the_next_save_full(tmp_path: Path) -> None:
    state = frozen_state(frozen=3, trained=1)
    assert _saves_of(tmp_path, range(1, 5), state, every=2, keep_last=None) == [1, 3]  # 4 refers to 3, records 1
    four = tmp_path / "step-00000004"
    _reseal(four, lambda doc: _add_reference(doc, tmp_path / "step-00000001", "train0"))  # and now to 1 too
    shardsafe.verify(four)
    assert sorted(manifest(four)["refs"]) == ["step-00000001", "step-00000003"]  # each a full save
    assert _saves_of(tmp_path, range(5, 6), state, every=10) == [5]


def test_one_manager_reads_each_referenced_manifest_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shardsafe.manager import chain as incremental

    reads: list[str] = []
    real = incremental._referenced_manifest
    monkeypatch.setattr(
        incremental, "_referenced_manifest", lambda fs, base, sid: reads.append(base) or real(fs, base, sid)
    )
    state = frozen_state(frozen=3, trained=1)
    with CheckpointManager(tmp_path, incremental=True, full_save_every=4, keep_last=1, save_on_signals=()) as mgr:
        for s in range(1, 10):
            mgr.save(s, state)
            step(state)
    assert [r.step for r in mgr.list()] == [9]
    assert not shardsafe.inspect(tmp_path / "step-00000009").bases  # full: 1, 5, 9
    assert reads == []  # each was read as the newest checkpoint already
    reads.clear()
    assert _saves_of(tmp_path, range(10, 13), expected(10, frozen=3, trained=1), every=4, keep_last=1) == []
    assert reads  # a new manager per save: read from storage again
