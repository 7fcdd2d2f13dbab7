"""Asynchronous save: the checkpoint holds the values at the call; failures surface on every rank."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.engine import staging

from harness import check_ok, run_ranks
from models import assert_same, build, full_state, needs_fsdp2_on_cpu, train


def _mutate(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    v.mul_(3.0)  # keeps exp_avg_sq positive, so training can go on


def _mutate_after_async(rank: int, world: int, path: str, strategy: str) -> dict[str, Any]:
    model, opt = build(strategy)
    train(model, opt, 2)
    before = full_state(model, opt)
    handle = shardsafe.async_save(path, {"model": model, "optimizer": opt}, timeout=60)
    _mutate(model, opt)  # at once: must not leak into the checkpoint
    handle.wait()
    assert handle.done() and handle.exception() is None
    fresh, fopt = build(strategy, seed=5)
    shardsafe.load(path, {"model": fresh, "optimizer": fopt}, timeout=60)
    assert_same(before, full_state(fresh, fopt))
    share = sum(c.nbytes for c in _planned(model, opt, rank, world))
    return {"staged": staging.staged_bytes(), "share": share}


def _planned(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, world: int) -> list[Any]:
    from shardsafe.engine.plan import plan_writes
    from shardsafe.state.flatten import flatten

    return plan_writes(flatten({"model": model, "optimizer": opt}).items, rank, world)


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=needs_fsdp2_on_cpu)])
def test_mutation_after_async_save_does_not_leak(tmp_path: Any, strategy: str) -> None:
    results = check_ok(run_ranks(_mutate_after_async, 2, str(tmp_path / "c"), strategy, timeout=120))
    for r in results:  # staging holds exactly this rank's share, never the whole replicated state
        assert r["staged"] == r["share"]
    total = shardsafe.inspect(str(tmp_path / "c")).total_bytes
    assert all(r["staged"] < total for r in results)


def test_mutation_after_async_save_plain(tmp_path: Any) -> None:
    _mutate_after_async(0, 1, str(tmp_path / "c"), "plain")


def _background_failure(rank: int, world: int, path: str) -> tuple[str, str, str]:
    model, _ = build("ddp")
    handle = shardsafe.async_save(path, {"model": model}, timeout=30)
    try:
        handle.wait()
    except Exception as err:
        cause = type(err.__cause__).__name__ if err.__cause__ else ""
        # the next save works (no poisoned state)
        os.environ.pop("SHARDSAFE_FAULT", None)
        shardsafe.save(path + "-next", {"model": model}, timeout=30)
        return type(err).__name__, str(err), cause
    return "none", "", ""


def test_background_failure_surfaces_on_every_rank(tmp_path: Any) -> None:
    path = str(tmp_path / "c")
    out = run_ranks(
        _background_failure, 2, path, timeout=120, rank_env={1: {"SHARDSAFE_FAULT": "save.write:rank=1:raise"}}
    )
    r0, r1 = check_ok(out)
    assert r0[0] == "RemoteRankError" and "rank 1" in r0[1] and "'write'" in r0[1]
    assert r1[0] == "UnforeseenError" and r1[2] == "InjectedFault" and "phase 'write'" in r1[1]
    with pytest.raises(shardsafe.CheckpointNotFoundError):
        shardsafe.load(path)
    shardsafe.verify(path + "-next")


def _unwaited_failure_raises_from_next_save(rank: int, world: int, path: str) -> str:
    model, _ = build("plain")
    shardsafe.async_save(path, {"model": model}, timeout=30)  # fails in the background, never waited for
    try:
        shardsafe.save(path + "-2", {"model": model}, timeout=30)
    except Exception as err:
        return type(err).__name__
    return "none"


def test_unwaited_background_failure_raises_from_next_save(tmp_path: Any) -> None:
    out = run_ranks(
        _unwaited_failure_raises_from_next_save,
        1,
        str(tmp_path / "c"),
        timeout=60,
        env={"SHARDSAFE_FAULT": "save.write:rank=0:raise"},
    )
    assert check_ok(out) == ["UnforeseenError"]


def test_overlapping_saves_each_hold_their_own_values(tmp_path: Any) -> None:
    model, opt = build("plain")
    train(model, opt, 1)
    first = full_state(model, opt)
    h1 = shardsafe.async_save(tmp_path / "a", {"model": model, "optimizer": opt})
    train(model, opt, 1, start=1)
    second = full_state(model, opt)
    h2 = shardsafe.async_save(tmp_path / "b", {"model": model, "optimizer": opt})  # waits for h1 first
    assert h1.done()
    h2.wait()
    for path, expected in ((tmp_path / "a", first), (tmp_path / "b", second)):
        m, o = build("plain", seed=9)
        shardsafe.load(path, {"model": m, "optimizer": o})
        assert_same(expected, full_state(m, o))


SCRIPT = textwrap.dedent(
    """
    import sys, torch, shardsafe
    state = {"w": torch.arange(8 * 2**20, dtype=torch.float32)}
    shardsafe.async_save(sys.argv[1], state)
    state["w"].zero_()
    # no wait(): interpreter exit must flush the pending save
    """
)


def test_exit_with_pending_save_flushes_it(tmp_path: Any) -> None:
    path = str(tmp_path / "c")
    subprocess.run([sys.executable, "-c", SCRIPT, path], check=True, timeout=120)
    assert torch.equal(shardsafe.load(path)["w"], torch.arange(8 * 2**20, dtype=torch.float32))


def test_exit_with_failing_pending_save_says_so(tmp_path: Any) -> None:
    path = str(tmp_path / "c")
    env = {**os.environ, "SHARDSAFE_FAULT": "save.write:rank=0:raise"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, path], timeout=120, env=env, capture_output=True, text=True)
    assert "did NOT complete" in done.stderr and "injected fault" in done.stderr


def _barriers_during_async_save(rank: int, world: int, path: str) -> bool:
    from shardsafe.coord import Deadlines, rendezvous

    model, opt = build("ddp")
    train(model, opt, 1)
    before = full_state(model, opt)
    handle = shardsafe.async_save(path, {"model": model, "optimizer": opt}, timeout=60)
    for i in range(5):  # runtime barriers while the background write and commit run
        rendezvous("barrier", f"b{i}", Deadlines(arrive=60, io=60))
    handle.wait()
    fresh, fopt = build("ddp", seed=3)
    shardsafe.load(path, {"model": fresh, "optimizer": fopt}, timeout=60)
    assert_same(before, full_state(fresh, fopt))
    return True


def test_rendezvous_of_other_operations_during_async_save(tmp_path: Any) -> None:
    # the background save's store keys must survive rank 0's cleanup of finished operations
    out = run_ranks(
        _barriers_during_async_save,
        2,
        str(tmp_path / "c"),
        timeout=120,
        env={"SHARDSAFE_FAULT": "save.report:rank=1:sleep=2"},
    )
    assert check_ok(out) == [True, True]


def _second_save_arrives_while_the_first_commits(rank: int, world: int, root: str) -> dict[str, Any]:
    from shardsafe.coord.client import StoreClient
    from shardsafe.coord.operation import Operation

    deleted: dict[int, float] = {}  # sequence -> when rank 0 first deleted one of its keys
    closed: dict[int, float] = {}  # sequence -> when this rank closed that operation
    delete, close = StoreClient.delete, Operation.close

    def deleting(self: StoreClient, key: str, *args: Any, **kwargs: Any) -> None:
        parts = key.split("/")
        if "ckpt" in parts and parts[parts.index("ckpt") + 1].isdigit():
            deleted.setdefault(int(parts[parts.index("ckpt") + 1]), time.time())
        delete(self, key, *args, **kwargs)

    def closing(self: Operation) -> None:
        closed.setdefault(self.session.seq, time.time())
        close(self)

    StoreClient.delete, Operation.close = deleting, closing  # type: ignore[method-assign]
    model, opt = build("ddp")
    state = {"model": model, "optimizer": opt}
    first = shardsafe.async_save(f"{root}/a", state, timeout=60)
    time.sleep(1.5)  # rank 0's first save waits in its commit round by now; rank 1's still writes its report
    second = shardsafe.async_save(f"{root}/b", state, timeout=60)
    first.wait()
    second.wait()
    shardsafe.load(f"{root}/b", state, timeout=60)  # a later operation: rank 0 deletes the keys of the closed ones
    return {"deleted": deleted, "closed": closed}


def test_a_save_arriving_while_another_commits_leaves_its_store_keys_alone(tmp_path: Any) -> None:
    """Two saves in flight: the second one's arrival (every rank there) let rank 0 delete the first one's
    store keys while that one was still in its commit round, so the first save could fail ("store lost":
    a read of a key deleted under it) or give the ranks different outcomes. Keys go once every rank has
    closed their operation: checked on the clocks of both ranks (on the old code rank 0 deleted the first
    save's keys before rank 1 closed it)."""
    env = {"SHARDSAFE_MAX_INFLIGHT_SAVES": "2", "SHARDSAFE_FAULT": "save.report:rank=1:sleep=3"}
    r0, r1 = check_ok(run_ranks(_second_save_arrives_while_the_first_commits, 2, str(tmp_path), timeout=120, env=env))
    for seq, when in r0["deleted"].items():
        assert when >= max(r0["closed"][seq], r1["closed"][seq]), f"operation {seq}'s keys deleted before it closed"
    saves = sorted(r1["closed"])[:2]
    assert sorted(r0["deleted"]) == saves, (r0["deleted"], r1["closed"])  # both saves' keys are gone by the end
    for name in ("a", "b"):
        shardsafe.verify(str(tmp_path / name))


def _two_in_flight(rank: int, world: int, root: str) -> dict[str, Any]:
    model, opt = build("ddp")
    expected, handles = [], []
    for i in range(3):
        train(model, opt, 1, start=i)
        expected.append(full_state(model, opt))
        handles.append(shardsafe.async_save(f"{root}/c{i}", {"model": model, "optimizer": opt}, timeout=60))
        if i == 1:
            # the second save started while the first was still writing (its report sleeps 3 s)
            overlapped = not handles[0].done()
        _mutate(model, opt)
    assert handles[0].done()  # the third save waited for the oldest: at most 2 in flight
    for h in handles:
        h.wait()
    for i, want in enumerate(expected):
        fresh, fopt = build("ddp", seed=11)
        shardsafe.load(f"{root}/c{i}", {"model": fresh, "optimizer": fopt}, timeout=60)
        assert_same(want, full_state(fresh, fopt))
    share = sum(c.nbytes for c in _planned(model, opt, rank, world))
    return {"overlapped": overlapped, "staged": staging.staged_bytes(), "share": share}


def test_saves_in_flight_are_configurable_and_bounded(tmp_path: Any) -> None:
    env = {"SHARDSAFE_MAX_INFLIGHT_SAVES": "2", "SHARDSAFE_FAULT": "save.report:rank=*:sleep=3"}
    results = check_ok(run_ranks(_two_in_flight, 2, str(tmp_path), timeout=180, env=env))
    for r in results:
        assert r["overlapped"]
        assert r["share"] < r["staged"] <= 2 * r["share"]  # two buffer sets at most
