"""The coordination core as a user, a crash and a freeze would meet it: one deadline end to end, one
outcome on every rank, errors that keep their kind, and a store-request count that cannot creep up.

- A load whose read hangs raises at its deadline, and the process can then exit (no reader thread
  keeps it alive).
- When the process hosting the store freezes (SIGSTOP: rank 0 under mp.spawn, SLURM or Lightning), the
  other ranks raise within ``timeout`` plus a few seconds, not after the store's own 30 minutes.
- A rank frozen during a load, declared dead, and woken up afterwards gets the outcome the others got.
- Two ranks that both hit a full disk both raise a CheckpointError (not a bare FileNotFoundError on
  the one whose staging the other already discarded).
- A manager failure only rank 0 can see (its listing of the root fails, when it chooses the base of an
  incremental save or when it resumes) reaches every rank within seconds, as an instance of the same
  class.
- The number of store requests per rank for a save and for a load is fixed (docs/architecture.md),
  and rank 0's does not grow with the number of ranks.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from hung_reads import run as run_hung
from hung_reads import script
from shardsafe.coord.client import StoreClient
from shardsafe.deadline import Deadline

from harness import check_ok, run_ranks


def _attempt(fn: Any) -> dict[str, Any]:
    t = time.monotonic()
    try:
        fn()
    except BaseException as err:
        return {
            "ok": False,
            "type": type(err).__name__,
            "mro": [c.__name__ for c in type(err).__mro__],
            "msg": str(err),
            "elapsed": time.monotonic() - t,
        }
    return {"ok": True, "elapsed": time.monotonic() - t}


# ----------------------------------------------------------------------------- a hung read


HUNG_READ = script(
    """
    path = sys.argv[1]
    shardsafe.save(path, {"w": torch.arange(1000.0)})
    LocalStorage.read_into = hung
    t = time.monotonic()
    try:
        shardsafe.load(path, {"w": torch.zeros(1000)}, timeout=1)
    except shardsafe.CheckpointError as err:
        print("RAISED", type(err).__name__, round(time.monotonic() - t, 1), flush=True)
    """
)


def test_the_process_exits_within_seconds_after_a_load_whose_read_hung(tmp_path: Path) -> None:
    started = time.monotonic()
    done, lines = run_hung(HUNG_READ, str(tmp_path / "c"))
    took = time.monotonic() - started
    assert lines.get("RAISED", [""])[0] == "CheckpointTimeoutError", (done.stdout, done.stderr[-2000:])
    assert done.returncode == 0, done.stderr[-2000:]
    assert took < 30, f"the process took {took:.0f}s to end after its load raised: a reader thread held it"


# ----------------------------------------------------------------------------- a frozen store host


def _frozen_host(rank: int, world: int, root: str) -> dict[str, Any]:
    Path(root, f"pid{rank}").write_text(str(os.getpid()))
    state = {"a": torch.full((1024,), 1.0), "b": torch.full((1024,), 2.0)}  # each rank writes one
    out = _attempt(lambda: shardsafe.save(f"{root}/c", state, timeout=8))
    if rank == 1:  # rank 0 is frozen (it hosts the store): end it, as a job scheduler would
        os.kill(int(Path(root, "pid0").read_text()), signal.SIGKILL)
    return out


def test_a_frozen_store_host_is_detected_within_the_timeout_on_the_other_ranks(tmp_path: Path) -> None:
    """Rank 0 hosts the store (store="tcp") and freezes while writing: rank 1, waiting for the outcome,
    raises within timeout + a few seconds (the store request itself is bounded)."""
    outs = run_ranks(
        _frozen_host, 2, str(tmp_path), timeout=90, store="tcp", env={"SHARDSAFE_FAULT": "save.write:rank=0:stop"}
    )
    r1 = outs[1].result
    assert r1 is not None, outs[1]
    assert not r1["ok"] and "CheckpointError" in r1["mro"], r1
    # timeout=8, plus SHARDSAFE_ERROR_REPORT_SECONDS (5) and slack for a loaded 2-core machine; without the
    # bounded store request it waits for the 1,800 s I/O deadline
    assert r1["elapsed"] < 8 + 5 + 12, r1
    assert outs[0].exitcode == -signal.SIGKILL


class _FrozenStore:
    """A store whose host froze: no request is answered until :attr:`thaw` is set."""

    def __init__(self) -> None:
        self.thaw = threading.Event()
        self.requests = 0

    def get(self, key: str) -> bytes:
        self.requests += 1
        self.thaw.wait(60)
        raise RuntimeError("thawed")


def test_past_the_deadline_a_frozen_store_costs_one_grace_not_one_per_request(monkeypatch: Any) -> None:
    """On the error path (the operation's deadline has passed) each store request gets the grace to
    report; when the store answers none in that grace it is lost for the operation, so the next
    requests raise at once: a frozen host ends a call within its timeout plus one grace, not one per
    request (the watchdog's ticks and the failure's messages queue up behind each other)."""
    monkeypatch.setenv("SHARDSAFE_ERROR_REPORT_SECONDS", "0.5")
    store = _FrozenStore()
    client = StoreClient(store, "a frozen host")  # type: ignore[arg-type]
    passed = Deadline.after(0, "test")
    start = time.monotonic()
    try:
        for _ in range(4):
            with pytest.raises(shardsafe.CheckpointError):
                client.get("k", passed)
        elapsed = time.monotonic() - start
    finally:
        store.thaw.set()
        client.close()
    assert store.requests == 1
    assert elapsed < 0.5 * 2, elapsed  # one grace, not four


# ----------------------------------------------------------------------------- a frozen rank wakes


def _frozen_load(rank: int, world: int, root: str) -> dict[str, Any]:
    Path(root, f"pid{rank}").write_text(str(os.getpid()))
    state = {"a": torch.full((64,), float(rank)), "b": torch.full((64,), 2.0)}
    shardsafe.save(f"{root}/c", state, timeout=60)
    os.environ["SHARDSAFE_FAULT"] = "load.read:rank=1:stop"  # rank 1 freezes inside the load
    try:
        out = _attempt(lambda: shardsafe.load(f"{root}/c", state, timeout=60))
    finally:
        del os.environ["SHARDSAFE_FAULT"]
    if rank == 0:  # the others have their outcome: wake rank 1 up
        os.kill(int(Path(root, "pid1").read_text()), signal.SIGCONT)
    return out


def test_a_rank_frozen_during_a_load_and_woken_gets_the_same_outcome(tmp_path: Path) -> None:
    env = {"SHARDSAFE_DEAD_AFTER": "2", "SHARDSAFE_HEARTBEAT_SECONDS": "0.25"}
    r0, r1 = check_ok(run_ranks(_frozen_load, 2, str(tmp_path), timeout=120, env=env))
    assert not r0["ok"] and r0["type"] == "RankDeadError" and "rank 1" in r0["msg"], r0
    assert not r1["ok"] and r1["type"] == "RankDeadError" and "rank 1" in r1["msg"], r1  # not a success


# ----------------------------------------------------------------------------- both disks full


def _both_full(rank: int, world: int, root: str) -> dict[str, Any]:
    from shardsafe.storage import local

    def full(_self: Any, _data: memoryview) -> None:
        if rank == 1:
            time.sleep(1.5)  # rank 0 has failed and discarded staging by now
        raise OSError(errno.ENOSPC, "No space left on device")

    local.LocalWriter.write = full  # type: ignore[method-assign]
    state = {"a": torch.full((4096,), 1.0), "b": torch.full((4096,), 2.0)}  # each rank writes one
    return _attempt(lambda: shardsafe.save(f"{root}/c", state, timeout=60))


def test_both_ranks_raise_a_checkpoint_error_when_both_disks_are_full(tmp_path: Path) -> None:
    r0, r1 = check_ok(run_ranks(_both_full, 2, str(tmp_path), timeout=120))
    for r in (r0, r1):
        assert not r["ok"] and "CheckpointError" in r["mro"], r
        assert "No space left on device" in r["msg"], r
    first = r0 if r0["type"] == "UnforeseenError" else r1  # the rank whose failure won: the others are its kind
    other = r1 if first is r0 else r0
    assert first["type"] in other["mro"], (first, other)
    assert not (tmp_path / "c").exists() and not [n for n in os.listdir(tmp_path) if "staging" in n]


# ----------------------------------------------------------------------------- rank 0's manager error


def _rank0_listing_fails(rank: int, world: int, root: str) -> dict[str, Any]:
    from shardsafe.manager import resume

    if rank == 0:
        real = resume.scan

        def denied(*args: Any, **kwargs: Any) -> Any:
            raise PermissionError(errno.EACCES, "Permission denied", root)

        resume.scan = denied  # type: ignore[assignment]
    model = torch.nn.Linear(4, 4)
    try:
        with shardsafe.CheckpointManager(root, every_n_steps=1, timeout=30) as mgr:
            return _attempt(lambda: mgr.resume({"model": model}))
    finally:
        if rank == 0:
            resume.scan = real  # type: ignore[assignment]


def _rank0_base_choice_fails(rank: int, world: int, root: str) -> dict[str, Any]:
    """An incremental manager whose rank 0 cannot list the root when it chooses the base of a save."""
    from shardsafe.manager import manager

    model = torch.nn.Linear(4, 4)
    with shardsafe.CheckpointManager(root, every_n_steps=1, incremental=True, timeout=30) as mgr:
        mgr.save(1, {"model": model})
        if rank == 0:

            def denied(*args: Any, **kwargs: Any) -> Any:
                raise PermissionError(errno.EACCES, "Permission denied", root)

            manager.scan = denied  # type: ignore[assignment]
        return _attempt(lambda: mgr.save(2, {"model": model}))


def test_a_manager_save_whose_base_choice_fails_on_rank0_fails_on_every_rank(tmp_path: Path) -> None:
    """Before: rank 0 raised PermissionError before it joined the save, and rank 1 waited out the arrival
    deadline (30 s) to say that rank 0 never arrived."""
    r0, r1 = check_ok(run_ranks(_rank0_base_choice_fails, 2, str(tmp_path), timeout=120))
    assert not r0["ok"] and "Permission denied" in r0["msg"], r0
    assert not r1["ok"] and "Permission denied" in r1["msg"] and "never arrived" not in r1["msg"], r1
    assert r0["type"] in r1["mro"] and "CheckpointError" in r1["mro"], (r0, r1)
    assert r1["elapsed"] < 10, r1


def test_a_manager_error_only_rank0_sees_reaches_every_rank_as_the_same_class(tmp_path: Path) -> None:
    r0, r1 = check_ok(run_ranks(_rank0_listing_fails, 2, str(tmp_path), timeout=120))
    assert not r0["ok"] and "Permission denied" in r0["msg"], r0
    assert not r1["ok"] and "Permission denied" in r1["msg"], r1
    assert r0["type"] in r1["mro"] and "CheckpointError" in r1["mro"], (r0, r1)
    assert r1["elapsed"] < 10, r1  # within seconds, not the 30 s arrival deadline


# ----------------------------------------------------------------------------- requests per rank


def _tally(rank: int, world: int, root: str) -> dict[str, Any]:
    from shardsafe.coord.operation import LAST_TALLY

    state = {"w": torch.full((256,), float(rank)), "step": 3}
    shardsafe.save(f"{root}/warm", state)  # connections opened, watchdog running
    shardsafe.save(f"{root}/c", state)
    save = LAST_TALLY["save"].as_dict()
    shardsafe.load(f"{root}/c", state)
    load = LAST_TALLY["load"].as_dict()
    return {"save": save, "load": load}


# Requests the caller waits for (answered by the store), per rank, for one save and one load of a state
# whose values agree on every rank. docs/architecture.md explains each; a change that adds one must
# change this table and the docs, and be measured (bench/protocol.py).
WAITED = {
    ("save", "leader"): {"get": 5, "compare_set": 3},
    ("save", "other"): {"add": 3, "get": 2},
    ("load", "leader"): {"get": 5, "compare_set": 2},
    ("load", "other"): {"add": 3, "get": 2},
}


@pytest.mark.parametrize("world", [2, 4])
def test_store_requests_per_rank_are_fixed_and_flat_in_the_number_of_ranks(tmp_path: Path, world: int) -> None:
    results = check_ok(run_ranks(_tally, world, str(tmp_path), timeout=180))
    for rank, got in enumerate(results):
        role = "leader" if rank == 0 else "other"
        for op in ("save", "load"):
            assert got[op]["waited"] == WAITED[(op, role)], (rank, op, got[op])
