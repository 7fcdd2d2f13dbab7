"""Liveness: nothing outside shardsafe can stall it into a false verdict, and nothing inside it hangs.

- A thread of the user's blocked in ``store.get`` on the process group's store client (TCPStore holds
  the client's lock for the whole wait) does not stop this rank's heartbeat nor its waits: with
  ``SHARDSAFE_DEAD_AFTER`` far below the blocked get and this rank slowed, its peer never declares it
  dead, and the save returns while the user's get is still blocked.
- A heartbeat that cannot reach the store is reported (WARNING) and the operation raises
  ``RankDeadError`` saying so, instead of being dropped at DEBUG.
- A local fsync that hangs (fault ``save.fsync``) makes the save fail at its deadline on that rank
  (and reach the other rank), instead of hanging it.
- The folders a save creates are fsynced into their parents.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import shardsafe
from shardsafe.coord import Deadlines, Empty, Operation
from shardsafe.coord.operation import ARRIVE
from shardsafe.storage import local

from harness import check_ok, run_ranks

BLOCKED_KEY = "user/never-set-until-the-save-is-done"


def _blocked_get_during_save(rank: int, world: int, path: str) -> dict[str, Any]:
    store = dist.distributed_c10d._get_default_store()
    out: dict[str, Any] = {}
    blocker = None
    if rank == 1:

        def user_thread() -> None:  # as NCCL's lazy set-up or a user's own rendezvous would
            store.set_timeout(timedelta(seconds=60))
            time.sleep(0.5)  # the save has started (its heartbeat ticks) when the get begins
            try:
                out["got"] = store.get(BLOCKED_KEY).decode()
            except Exception as err:
                out["got"] = f"{type(err).__name__}: {err}"

        blocker = threading.Thread(target=user_thread, daemon=True)
        blocker.start()
    state = {"a": torch.zeros(1024), "b": torch.ones(1024)}  # each rank writes one
    os.environ["SHARDSAFE_FAULT"] = "save.write:rank=1:sleep=3"  # rank 0 waits on rank 1 past DEAD_AFTER
    try:
        shardsafe.save(path, state, timeout=60)
    finally:
        del os.environ["SHARDSAFE_FAULT"]
    if blocker is not None:
        out["blocked_while_saving"] = blocker.is_alive()
    shardsafe.load(path, state, timeout=60)  # and the next operation works too
    if rank == 0:
        store.set(BLOCKED_KEY, "released")
    if blocker is not None:
        blocker.join(60)
    return out


def test_a_thread_blocked_in_store_get_does_not_get_its_rank_declared_dead(tmp_path: Path) -> None:
    env = {"SHARDSAFE_DEAD_AFTER": "1.5", "SHARDSAFE_HEARTBEAT_SECONDS": "0.25"}
    _, r1 = check_ok(run_ranks(_blocked_get_during_save, 2, str(tmp_path / "c"), timeout=150, env=env))
    assert r1["blocked_while_saving"], "the user's get returned before the save did: nothing was tested"
    assert r1["got"] == "released", r1
    shardsafe.verify(str(tmp_path / "c"))


STORE_HOST = """
import datetime, sys, time
from torch.distributed import TCPStore
s = TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
print(s.port, flush=True)
time.sleep(120)
"""


def test_a_heartbeat_that_loses_the_store_is_reported_and_raises(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """This process is rank 1 of 2, waiting for rank 0 (which never comes) in an operation with a long
    deadline; the process hosting the store freezes (SIGSTOP). The watchdog's next tick gets no answer
    within SHARDSAFE_DEAD_AFTER: a WARNING says so and the wait raises RankDeadError at once, not at the
    deadline."""
    monkeypatch.setenv("SHARDSAFE_HEARTBEAT_SECONDS", "0.05")
    monkeypatch.setenv("SHARDSAFE_DEAD_AFTER", "2")
    host = subprocess.Popen([sys.executable, "-c", STORE_HOST], stdout=subprocess.PIPE, text=True)
    try:
        port = int(host.stdout.readline()) if host.stdout is not None else 0
        store = dist.TCPStore("127.0.0.1", port, 1, is_master=False, timeout=timedelta(seconds=30))
        op = Operation.begin("save", "/ckpt", Deadlines(arrive=30, io=30).start(), store=store, rank=1, world_size=2)
        threading.Timer(1.0, lambda: os.kill(host.pid, signal.SIGSTOP)).start()
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="shardsafe"), pytest.raises(shardsafe.RankDeadError) as info:
            op.agree(ARRIVE, Empty())
        op.close()
    finally:
        host.kill()
    assert info.value.store_lost and time.monotonic() - started < 15, info.value  # not the 30 s deadline
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("heartbeat of rank 1" in m for m in warnings), warnings
    assert "heartbeat of rank 1" in str(info.value), info.value


def _hung_fsync(rank: int, world: int, root: str) -> dict[str, Any]:
    state = {"a": torch.full((4096,), 1.0), "b": torch.full((4096,), 2.0)}  # each rank writes one
    shardsafe.save(f"{root}/ckpt", state, timeout=30)
    os.environ["SHARDSAFE_FAULT"] = "save.fsync:rank=1:sleep=600"  # a disk that never answers
    try:
        shardsafe.save(f"{root}/ckpt", state, overwrite=True, timeout=3)
    except shardsafe.CheckpointError as err:
        return {"error": type(err).__name__, "msg": str(err), "cause": repr(err.__cause__)}
    finally:
        del os.environ["SHARDSAFE_FAULT"]
    return {"error": None}


def test_a_hung_local_fsync_fails_the_save_at_its_deadline_instead_of_hanging(tmp_path: Path) -> None:
    outcomes = run_ranks(_hung_fsync, 2, str(tmp_path), timeout=90)  # a hang would be killed here
    r0, r1 = check_ok(outcomes)
    assert r1["error"] == "CheckpointTimeoutError", r1  # every timeout shardsafe raises is one
    assert "fsync" in r1["msg"] and "data-00001-" in r1["msg"], r1  # names what hung, and where
    assert "timeout=" in r1["msg"], r1  # and the fix
    assert r0["error"] == "RemoteRankError" and "rank 1" in r0["msg"], r0
    shardsafe.verify(str(tmp_path / "ckpt"))  # the previous checkpoint is untouched
    assert not [n for n in os.listdir(tmp_path) if ".staging-" in n]


def test_the_folders_a_save_creates_are_fsynced_into_their_parents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[str] = []
    real = local.fsync_dir

    def record(path: str) -> None:
        synced.append(os.path.abspath(path))
        real(path)

    monkeypatch.setattr(local, "fsync_dir", record)
    shardsafe.save(str(tmp_path / "runs" / "exp1" / "step-1"), {"x": torch.zeros(3)})
    for parent in (tmp_path, tmp_path / "runs", tmp_path / "runs" / "exp1"):  # parents of each new folder
        assert str(parent) in synced, (parent, synced)
