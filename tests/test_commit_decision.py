"""One decision per save: whatever the interleaving of a slow rank 0 and another rank's deadline,
every rank sees one outcome, and the storage agrees with it.

Rank 0 is slowed (fault injection ``sleep``) before it decides (``save.commit``) or while it publishes
(``save.publish``), past rank 1's deadline; on local and ``file://`` paths, for an overwrite of a
committed checkpoint and for a new path. Afterwards either both ranks returned and the target verifies
with the new save, or both raised and the target is exactly what it was before (the old checkpoint,
or nothing), with no staging left behind.

Also: ranks with different ``SHARDSAFE_CHECKSUM_BLOCK_BYTES`` write one checkpoint that verifies and
loads (rank 0 chooses the block size for everyone).
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe

from harness import check_ok, run_ranks

SLOW = 2.5  # rank 0's delay
SHORT = 1.5  # rank 1's deadline, well under the delay
# (fault, rank 0's deadline): slowed before deciding; publishing, with a deadline that outlasts the
# delay (commits) and with one that does not (the publish is called off)
SCENARIOS = [
    (f"save.commit:rank=0:sleep={SLOW}", 30.0),
    (f"save.publish:rank=0:sleep={SLOW}", 30.0),
    (f"save.publish:rank=0:sleep={SLOW}", SHORT),
]


def _attempt(fn: Any) -> dict[str, Any]:
    try:
        fn()
    except Exception as err:
        return {"ok": False, "error": f"{type(err).__name__}: {err}"}
    return {"ok": True}


def _faulted(fault: str, target: str, state: dict[str, Any], timeout: float) -> dict[str, Any]:
    os.environ["SHARDSAFE_FAULT"] = fault
    try:
        return _attempt(lambda: shardsafe.save(target, state, overwrite=True, timeout=timeout))
    finally:
        del os.environ["SHARDSAFE_FAULT"]


def _slow_rank0(rank: int, world: int, base: str) -> list[dict[str, Any]]:
    out = []
    for i, (fault, lead) in enumerate(SCENARIOS):
        timeout = lead if rank == 0 else SHORT
        for overwrite in (True, False):
            target = f"{base}/s{i}-{'over' if overwrite else 'new'}"
            value = torch.full((256,), float(rank == rank))
            if overwrite:
                shardsafe.save(target, {"v": value, "attempt": 0}, timeout=60)
            before = shardsafe.inspect(target).save_id if overwrite else None
            got = _faulted(fault, target, {"v": value, "attempt": 1}, timeout)
            out.append({"target": target, "before": before, **got})
    return out


def _local(base: str) -> str:
    return base.removeprefix("file://")


def _one_outcome(tmp_path: Path, kind: str) -> list[str]:
    (tmp_path / kind).mkdir()
    base = str(tmp_path / kind) if kind == "local" else f"file://{tmp_path / kind}"
    r0, r1 = check_ok(run_ranks(_slow_rank0, 2, base, timeout=120))
    problems = []
    for a, b in zip(r0, r1, strict=True):
        target = a["target"]
        if a["ok"] != b["ok"]:
            problems.append(f"{target}: two outcomes: rank 0 {a}, rank 1 {b}")
            continue
        committed = os.path.exists(f"{_local(target)}/MANIFEST.json")
        if a["ok"]:
            shardsafe.verify(target)
            if shardsafe.load(target)["attempt"] != 1:
                problems.append(f"{target}: both returned, but the new save is not what is committed")
        elif a["before"] is None and committed:
            problems.append(f"{target}: both raised, but a checkpoint was committed")
        elif a["before"] is not None:
            shardsafe.verify(target)
            if shardsafe.inspect(target).save_id != a["before"]:
                problems.append(f"{target}: both raised, but the committed checkpoint changed")
    root = tmp_path / kind
    leftovers = [n for n in os.listdir(root) if ".staging-" in n]
    leftovers += [f"{d}/{n}" for d in os.listdir(root) for n in os.listdir(root / d) if ".tmp" in n]
    problems += [f"left behind: {n}" for n in leftovers]
    if not any(a["ok"] for a in r0) or all(a["ok"] for a in r0):
        problems.append(f"{kind}: the scenarios did not produce both outcomes: {r0}")
    return problems


def test_a_publish_slower_than_another_ranks_deadline_gives_one_outcome_everywhere(tmp_path: Path) -> None:
    with ThreadPoolExecutor(2) as pool:  # local and file:// paths side by side: the waits overlap
        problems = [p for ps in pool.map(lambda k: _one_outcome(tmp_path, k), ["local", "file"]) for p in ps]
    assert not problems, "\n".join(problems)


def _mixed_blocks(rank: int, world: int, path: str) -> None:
    torch.manual_seed(0)
    state = {f"t{i}": torch.randn(64, 1024) for i in range(4)}  # 256 KiB each: both ranks write some
    shardsafe.save(path, state, timeout=60)
    got = {k: torch.empty(64, 1024) for k in state}
    shardsafe.load(path, got, timeout=60)
    assert all(torch.equal(got[k], state[k]) for k in state)


def test_ranks_with_different_checksum_block_sizes_write_a_loadable_checkpoint(tmp_path: Path) -> None:
    path = str(tmp_path / "c")
    blocks = {0: {"SHARDSAFE_CHECKSUM_BLOCK_BYTES": "65536"}, 1: {"SHARDSAFE_CHECKSUM_BLOCK_BYTES": "4096"}}
    check_ok(run_ranks(_mixed_blocks, 2, path, timeout=120, rank_env=blocks))
    shardsafe.verify(path)
    assert shardsafe.inspect(path).files and len(shardsafe.inspect(path).files) == 2


def test_a_publish_stuck_in_its_atomic_step_is_reported_and_its_data_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rename hangs past the deadline (a stuck filesystem): the save raises saying the outcome is
    open, removes nothing, and when the rename finally lands the checkpoint is whole."""
    from shardsafe.storage.local import LocalStorage

    real = LocalStorage.publish
    landed = threading.Event()

    def stuck(self: LocalStorage, *args: Any, at_commit: Any, **kwargs: Any) -> bytes | None:
        def late() -> None:
            at_commit()
            time.sleep(2.0)  # inside the atomic step, past the 0.5 s deadline

        try:
            return real(self, *args, at_commit=late, **kwargs)
        finally:
            landed.set()

    monkeypatch.setattr(LocalStorage, "publish", stuck)
    path = str(tmp_path / "c")
    with pytest.raises(shardsafe.CheckpointError, match="may still complete") as info:
        shardsafe.save(path, {"x": torch.arange(1000.0)}, timeout=0.5)
    assert "Nothing was committed" not in str(info.value)
    assert landed.wait(30)
    shardsafe.verify(path)  # committed late, with all its data: nothing was removed under it
    assert torch.equal(shardsafe.load(path)["x"], torch.arange(1000.0))
