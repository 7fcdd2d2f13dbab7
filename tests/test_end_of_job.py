"""End of job: rank 0 hosts the rendezvous store (SLURM ``srun``, ``mp.spawn``, Lightning's launcher)
and ends its process the instant its last ``save`` / ``async_save(...).wait()`` / ``load`` returns
(``os._exit(0)``, the usual way around a slow NCCL teardown). The other ranks must still return
normally: rank 0 returns only once every live rank has read the outcome.

Each scenario runs ``TRIALS`` times on fresh processes, half with ``init_method="tcp://..."`` and half
with ``env://``; not one trial may fail on the other ranks. ``SHARDSAFE_TEST_END_TRIALS`` (default 10)
chooses the count; a long run is e.g. ``SHARDSAFE_TEST_END_TRIALS=200``.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe

from harness import Outcome, run_ranks

TRIALS = int(os.environ.get("SHARDSAFE_TEST_END_TRIALS", "10"))
WORLD = 3


def _then_exit(rank: int, world: int, path: str, op: str) -> str:
    # No DDP wrapper or optimizer: their set-up costs seconds per process, and the store is what is tested.
    torch.manual_seed(0)
    state = {"model": torch.nn.Linear(64, 32), "blob": torch.full((64, 1024), 1.0), "step": 3}
    if op == "load":
        shardsafe.save(path, state, timeout=60)
        shardsafe.load(path, state, timeout=60)
    elif op == "async":
        shardsafe.async_save(path, state, timeout=60).wait()
    else:
        shardsafe.save(path, state, timeout=60)
    if rank == 0:
        os._exit(0)  # the store goes with this process
    return "ok"


def _trial(root: Path, op: str, i: int) -> tuple[str, list[Outcome]]:
    path = str(root / f"{op}{i}")
    mode = "tcp" if i % 2 == 0 else "env"
    return path, run_ranks(_then_exit, WORLD, path, op, timeout=90, store=mode)


@pytest.mark.parametrize("op", ["save", "async", "load"])
def test_rank0_leaving_right_after_the_call_strands_no_other_rank(tmp_path: Path, op: str) -> None:
    with ThreadPoolExecutor(4) as pool:
        trials = list(pool.map(lambda i: _trial(tmp_path, op, i), range(TRIALS)))
    failed: dict[str, list[str]] = {}
    for path, outcomes in trials:
        if outcomes[0].exitcode != 0:
            failed.setdefault(path, []).append(f"rank 0 did not reach os._exit(0): {outcomes[0]}")
        for o in outcomes[1:]:
            if not o.ok or o.result != "ok":
                failed.setdefault(path, []).append(f"rank {o.rank}: {o.error_type}: {o.error}")
        try:
            shardsafe.verify(path)  # committed and whole, whatever the trial
        except shardsafe.CheckpointError as err:  # reported with what each rank said, not alone
            failed.setdefault(path, []).append(f"not committed and whole: {err}; rank 0: {outcomes[0]}")
    detail = "\n".join(f"{p}: {m}" for p, ms in list(failed.items())[:3] for m in ms)
    assert not failed, f"{op}: {len(failed)} of {TRIALS} trials failed on other ranks, e.g.:\n{detail}"


def _store_lost_after_report(rank: int, world: int, path: str) -> dict[str, Any]:
    """Rank 0 dies (SIGKILL) right after publishing, before anyone read the outcome from the store it
    hosts: the others see the store vanish, ask the storage, find their save committed, and return."""
    os.environ["SHARDSAFE_FAULT"] = "save.confirm:rank=0:kill"
    try:
        shardsafe.save(path, {"model": torch.nn.Linear(8, 4)}, timeout=30)
    except shardsafe.CheckpointError as err:
        return {"ok": False, "error": f"{type(err).__name__}: {err}"}
    return {"ok": True}


def test_a_rank_that_loses_the_store_after_the_commit_asks_the_storage(tmp_path: Path) -> None:
    path = str(tmp_path / "c")
    outcomes = run_ranks(_store_lost_after_report, WORLD, path, timeout=90, store="tcp")
    assert outcomes[0].exitcode == -9, outcomes[0]
    for o in outcomes[1:]:
        assert o.ok and o.result == {"ok": True}, o
    shardsafe.verify(path)
