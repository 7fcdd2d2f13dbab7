"""Preemption: signal handlers that only set a flag, the stop step agreed through the store, the
save schedule, and a 2-rank run stopped by SIGTERM that commits, exits cleanly and resumes."""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardsafe.coord.client import StoreClient
from shardsafe.coord.steps import StepBroadcast, StopAgreement, StoreKeys
from shardsafe.deadline import Deadline
from shardsafe.errors import RankTimeoutError
from shardsafe.manager import CheckpointManager, ManagerConfig
from shardsafe.manager.preemption import SignalFlag
from shardsafe.manager.schedule import INTERVAL, PREEMPTION, TICK, TIME, Schedule

from harness import Outcome, check_ok, run_ranks


def _wait_for(cond: Any, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_signal_flag_sets_a_flag_and_restores_the_previous_handler() -> None:
    seen: list[int] = []

    def previous(signum: int, frame: Any) -> None:
        seen.append(signum)

    old = signal.signal(signal.SIGUSR1, previous)
    try:
        flag = SignalFlag((signal.SIGUSR1,))
        os.kill(os.getpid(), signal.SIGUSR1)
        _wait_for(lambda: flag.received is not None)
        assert flag.received == signal.SIGUSR1 and seen == []  # the handler only set the flag
        flag.restore()
        assert signal.getsignal(signal.SIGUSR1) is previous
        os.kill(os.getpid(), signal.SIGUSR1)
        _wait_for(lambda: seen != [])
        assert seen == [signal.SIGUSR1]

        flag = SignalFlag((signal.SIGUSR1,))
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # someone else took the signal over since
        flag.restore()
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN  # theirs stays
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_signal_flag_outside_the_main_thread_says_what_to_do() -> None:
    errors: list[BaseException] = []

    def make() -> None:
        try:
            SignalFlag((signal.SIGTERM,))
        except ValueError as err:
            errors.append(err)

    t = threading.Thread(target=make)
    t.start()
    t.join(10)
    assert len(errors) == 1 and "main thread" in str(errors[0]) and "save_on_signals=()" in str(errors[0])
    SignalFlag(()).restore()  # no signals: fine in any thread, nothing installed


def test_stop_agreement_first_proposal_wins_for_every_rank() -> None:
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    client = StoreClient(store, "test")
    rank0 = StopAgreement(StoreKeys(client, "ns/manager/0", 10))
    rank1 = StopAgreement(StoreKeys(client, "ns/manager/0", 10))
    assert rank0.agreed() is None and rank1.agreed() is None
    assert rank1.propose(8) == 8
    assert rank0.propose(5) == 8  # too late: rank 1's proposal stands
    assert rank0.agreed() == 8 == rank1.agreed()
    assert StopAgreement(StoreKeys(client, "ns/manager/1", 10)).agreed() is None
    local = StopAgreement(None)
    assert local.propose(3) == 3 and local.propose(9) == 3 and local.agreed() == 3


def test_step_broadcast_passes_rank0_decision_and_cleans_up_its_keys() -> None:
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    client = StoreClient(store, "test")
    keys = StoreKeys(client, "ns/manager/0", 0.3)
    rank0, rank1 = (StepBroadcast(keys, TICK, rank=r, world_size=2) for r in (0, 1))
    assert rank0.share(5, "1") == "1"
    assert rank1.share(5, None) == "1"
    soon = Deadline.after(10, "test")  # the deletes are posted: a request on the same client comes after them
    assert not client.check([keys.key("every_seconds", "5")], soon)
    assert not client.check([keys.key("every_seconds", "5", "read")], soon)
    with pytest.raises(RankTimeoutError) as info:
        rank1.share(6, None)  # rank 0 never asked about step 6
    assert info.value.missing_ranks == [0] and "same steps" in str(info.value)


def _schedule(clock: list[float], **kwargs: Any) -> tuple[Schedule, SignalFlag]:
    flag = SignalFlag(())
    config = ManagerConfig(root="/tmp/unused", save_on_signals=(), **kwargs)
    sched = Schedule(
        config,
        rank=0,
        flag=flag,
        stop=StopAgreement(None),
        tick=StepBroadcast(None, TICK, rank=0, world_size=1),
        clock=lambda: clock[0],
    )
    return sched, flag


def test_schedule_time_interval_counts_from_the_last_save_start() -> None:
    clock = [0.0]
    sched, _ = _schedule(clock, every_seconds=10.0, every_n_steps=100)
    assert sched.reason(1) is None
    clock[0] = 11.0
    assert sched.reason(2) == TIME
    sched.started()
    sched.saved(2)
    assert sched.reason(2) is None  # saved already
    clock[0] = 15.0
    assert sched.reason(3) is None
    clock[0] = 100.0
    assert sched.reason(3) is None  # asked twice for a step: the first answer stands
    assert sched.reason(100) == INTERVAL


def test_schedule_preemption_saves_at_the_next_step_then_stops() -> None:
    clock = [0.0]
    sched, flag = _schedule(clock, every_n_steps=10)
    assert sched.reason(4) is None
    flag.received = signal.SIGTERM
    assert sched.reason(5) is None  # proposes step 6: other ranks may be past their check for 5
    assert sched.stop_step == 6
    assert sched.reason(6) == PREEMPTION and not sched.stopped
    sched.saved(6)
    assert sched.stopped
    assert sched.reason(7) is None and sched.reason(10) == INTERVAL


def test_manager_in_one_process_stops_after_flushing_an_async_preemption_save(tmp_path: Path) -> None:
    state = {"model": torch.nn.Linear(2, 2)}
    before = signal.getsignal(signal.SIGUSR1)
    mgr = CheckpointManager(tmp_path, every_n_steps=100, async_save=True, save_on_signals=(signal.SIGUSR1,))
    assert mgr.maybe_save(1, state) is False
    os.kill(os.getpid(), signal.SIGUSR1)
    _wait_for(lambda: mgr._flag.received is not None)
    assert mgr.maybe_save(2, state) is False and not mgr.should_stop()
    assert mgr.maybe_save(3, state) is True and mgr.should_stop()
    assert (tmp_path / "step-00000003" / "MANIFEST.json").exists()  # flushed, not still in flight
    mgr.close()
    assert signal.getsignal(signal.SIGUSR1) == before


# ------------------------------------------------------------------------- two ranks, SIGTERM


def _preempted_worker(rank: int, world: int, root: str, pid_dir: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "opt": opt}
    with CheckpointManager(root, every_n_steps=1000, keep_last=2) as mgr:
        Path(pid_dir, f"{rank}.pid").write_text(str(os.getpid()))
        step = 0
        while step < 5000:  # bounded: the test sends SIGTERM long before
            step += 1
            model(torch.randn(2, 8)).sum().backward()  # DDP's all-reduce keeps the ranks in lockstep
            opt.step()
            opt.zero_grad()
            time.sleep(0.02)
            mgr.maybe_save(step, state)
            if mgr.should_stop():
                break
        checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
        return {"step": step, "stopped": mgr.should_stop(), "checksum": checksum}


def _resumed_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    torch.manual_seed(1)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with CheckpointManager(root, save_on_signals=()) as mgr:
        step = mgr.resume({"model": model, "opt": opt})
    return {"step": step, "checksum": float(sum(p.detach().double().sum() for p in model.parameters()))}


def test_sigterm_to_both_ranks_commits_at_the_agreed_step_exits_cleanly_and_resumes(tmp_path: Path) -> None:
    root, pid_dir = tmp_path / "run", tmp_path / "pids"
    pid_dir.mkdir()
    results: list[list[Outcome]] = []
    runner = threading.Thread(target=lambda: results.append(run_ranks(_preempted_worker, 2, str(root), str(pid_dir))))
    runner.start()
    pid_files = [pid_dir / "0.pid", pid_dir / "1.pid"]
    _wait_for(lambda: all(p.exists() and p.read_text() for p in pid_files), seconds=90)
    assert all(p.exists() for p in pid_files), "workers never started their loop"
    time.sleep(0.3)  # let them train a few steps
    for p in reversed(pid_files):  # as a scheduler would: every worker, at (nearly) the same time
        os.kill(int(p.read_text()), signal.SIGTERM)
    runner.join(150)
    assert not runner.is_alive() and results
    r0, r1 = check_ok(results[0])
    assert r0["stopped"] and r1["stopped"]
    assert r0["step"] == r1["step"] and r0["step"] < 5000
    assert [o.exitcode for o in results[0]] == [0, 0]
    stop = r0["step"]
    assert (root / f"step-{stop:08d}" / "MANIFEST.json").exists()

    after = check_ok(run_ranks(_resumed_worker, 2, str(root), timeout=120))
    assert [a["step"] for a in after] == [stop, stop]
    assert after[0]["checksum"] == pytest.approx(r0["checksum"], abs=0.0)
