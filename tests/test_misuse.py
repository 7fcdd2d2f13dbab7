"""Misuse never hangs. A save or load called on a subset of ranks (the ``if rank == 0:`` guard) raises
``RankTimeoutError`` on the ranks that called, within the deadline, naming the missing ranks, the path
and the remedy; ranks out of step (other path, other operation, other state) raise on every rank with
what each did. Afterwards the next save and load called by every rank work (no poisoned state)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import shardsafe

from harness import check_ok, run_ranks
from models import build, full_state, needs_fsdp2_on_cpu, train

T = 5.0  # the deadline of the misused calls: the guard must fail within T + 10 s


def _attempt(fn: Callable[[], object]) -> dict[str, Any]:
    """Run ``fn``; describe how it ended (by value: the parent asserts)."""
    started = time.monotonic()
    try:
        fn()
    except Exception as err:
        return {
            "ok": False,
            "type": type(err).__name__,
            "mro": [c.__name__ for c in type(err).__mro__],
            "msg": str(err),
            "elapsed": time.monotonic() - started,
        }
    return {"ok": True, "elapsed": time.monotonic() - started}


def _signal(rank: int, key: str) -> None:
    """Rank 0 says it is done with ``key``; the others wait for that (test choreography via the store)."""
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.set(key, "1")
    else:
        store.wait([key], timedelta(seconds=60))


def _rank0_guard(rank: int, world: int, root: str, strategy: str) -> dict[str, Any]:
    model, opt = build(strategy)
    train(model, opt, 1)
    state = {"model": model, "optimizer": opt, "step": 1}
    ckpt = f"{root}/ckpt"
    out: dict[str, Any] = {}
    if rank == 0:  # the classic mistake; the other ranks are busy elsewhere meanwhile
        out["save_guard"] = _attempt(lambda: shardsafe.save(f"{root}/guarded", state, timeout=T))
        out["after_save_guard"] = sorted(os.listdir(root))
    _signal(rank, "test/save-guard-done")
    out["save"] = _attempt(lambda: shardsafe.save(ckpt, state, timeout=T))
    if rank == 0:
        out["load_guard"] = _attempt(lambda: shardsafe.load(ckpt, {"model": model}, timeout=T))
    _signal(rank, "test/load-guard-done")
    model2, opt2 = build(strategy, seed=1)
    loaded: dict[str, Any] = {"model": model2, "optimizer": opt2, "step": 0}
    out["load"] = _attempt(lambda: shardsafe.load(ckpt, loaded, timeout=T))
    if out["load"]["ok"]:
        mine, theirs = full_state(model, opt), full_state(model2, opt2)
        out["bitwise"] = sorted(mine) == sorted(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)
        out["step"] = loaded["step"]
    out["save_again"] = _attempt(lambda: shardsafe.save(ckpt, state, overwrite=True, timeout=T))
    return out


@needs_fsdp2_on_cpu
def test_rank0_guard_raises_naming_missing_rank_then_every_rank_saves_and_loads(tmp_path: Any) -> None:
    strategies = ["ddp", "fsdp"]  # replicated and sharded state, run side by side (the waits overlap)
    for s in strategies:
        (tmp_path / s).mkdir()
    with ThreadPoolExecutor(len(strategies)) as pool:
        runs = list(pool.map(lambda s: run_ranks(_rank0_guard, 2, str(tmp_path / s), s, timeout=120), strategies))
    for strategy, outcomes in zip(strategies, runs, strict=True):
        root = str(tmp_path / strategy)
        r0, r1 = check_ok(outcomes)
        for what in ("save_guard", "load_guard"):
            err = r0[what]
            assert not err["ok"], f"{strategy} {what}: a save/load on rank 0 alone must fail"
            assert err["type"] == "RankTimeoutError" and "TimeoutError" in err["mro"], err
            assert "ranks [1] never arrived" in err["msg"], err["msg"]
            assert "every rank" in err["msg"], err["msg"]
            assert err["elapsed"] < T + 10, err
        assert f"{root}/guarded" in r0["save_guard"]["msg"]
        assert f"{root}/ckpt" in r0["load_guard"]["msg"]
        assert r0["after_save_guard"] == [], f"{strategy}: a guarded save left something behind"
        for r in (r0, r1):
            for what in ("save", "load", "save_again"):
                assert r[what]["ok"], (strategy, what, r[what])
            assert r["bitwise"] and r["step"] == 1
        shardsafe.verify(f"{root}/ckpt")
        assert sorted(os.listdir(root)) == ["ckpt"]


def _out_of_step(rank: int, world: int, root: str) -> dict[str, Any]:
    values = {"x": torch.arange(6.0).reshape(2, 3), "step": 3}
    same = f"{root}/same"
    out: dict[str, Any] = {
        "paths": _attempt(lambda: shardsafe.save(f"{root}/p{rank}", values, timeout=T)),
        "ops": _attempt(
            lambda: shardsafe.save(same, values, timeout=T) if rank == 0 else shardsafe.load(same, {"x": values["x"]})
        ),
    }
    shapes = values if rank == 0 else {**values, "extra": torch.zeros(2)}
    out["structure"] = _attempt(lambda: shardsafe.save(same, shapes, timeout=T))
    out["after_structure"] = sorted(os.listdir(root))  # rank 0 removes staging before it returns
    out["save"] = _attempt(lambda: shardsafe.save(same, values, timeout=T))
    back: dict[str, Any] = {"x": torch.zeros(2, 3), "step": 0}
    out["load"] = _attempt(lambda: shardsafe.load(same, back, timeout=T))
    out["loaded"] = (back["x"].tolist(), back["step"])
    return out


def test_out_of_step_ranks_raise_on_every_rank_with_what_each_did(tmp_path: Any) -> None:
    root = str(tmp_path)
    results = check_ok(run_ranks(_out_of_step, 2, root, timeout=120))
    for r in results:
        paths, ops = r["paths"], r["ops"]
        assert paths["type"] == ops["type"] == "RankDesyncError", (paths, ops)
        assert f"rank 0: save('{root}/p0')" in paths["msg"] and f"rank 1: save('{root}/p1')" in paths["msg"], paths
        assert f"rank 0: save('{root}/same')" in ops["msg"] and f"rank 1: load('{root}/same')" in ops["msg"], ops
        assert paths["elapsed"] < T + 10 and ops["elapsed"] < T + 10
        assert not r["structure"]["ok"], "ranks saving different state structures must not commit"
        assert r["save"]["ok"] and r["load"]["ok"], (r["save"], r["load"])
        assert r["loaded"] == ([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], 3)
    r0, r1 = results
    assert r0["after_structure"] == [], "a save refused for mismatched state left something behind"
    assert r0["structure"]["type"] == "InconsistentRanksError" and "ranks [1]" in r0["structure"]["msg"], r0[
        "structure"
    ]
    assert r1["structure"]["type"] == "RemoteRankError" and "rank 0" in r1["structure"]["msg"], r1["structure"]


def test_a_misspelt_save_option_raises_type_error_before_anything_is_written(tmp_path: Any) -> None:
    """The options are keyword arguments in one table (SaveOptions): a typo is refused, as Python refuses
    one for a plain function, naming the keyword and the known options, and nothing is created."""
    path = tmp_path / "c"
    for fn in (shardsafe.save, shardsafe.async_save):
        try:
            fn(str(path), {"x": torch.ones(3)}, overwite=True)  # type: ignore[call-arg]
        except TypeError as err:
            assert isinstance(err, shardsafe.CheckpointError)
            assert "'overwite'" in str(err) and "overwrite" in str(err).split(";")[1], err
        else:
            raise AssertionError(f"{fn.__name__} accepted a misspelt keyword")
        assert not path.exists() and os.listdir(tmp_path) == []


def test_save_and_async_save_show_every_option_with_its_default() -> None:
    import inspect

    from shardsafe.engine.options import DEFAULTS

    for fn in (shardsafe.save, shardsafe.async_save):
        params = inspect.signature(fn).parameters
        assert list(params) == ["path", "state", *shardsafe.SaveOptions.__annotations__], fn.__name__
        assert {k: params[k].default for k in DEFAULTS} == DEFAULTS
        assert all(params[k].kind is inspect.Parameter.KEYWORD_ONLY for k in DEFAULTS)
    assert DEFAULTS["overwrite"] is False and DEFAULTS["allow_pickle"] is False


def _late_rank(rank: int, world: int, root: str) -> list[str]:
    """Rank 1 reaches the save 4 s after rank 0, whose arrival deadline is 100 s: rank 0 says, long
    before that deadline, which rank is missing and what the ``if rank == 0:`` guard would cost."""
    import logging

    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logging.getLogger("shardsafe").addHandler(Keep())
    if rank == 1:
        time.sleep(4.0)  # a rank still finishing a long step
    deadlines = shardsafe.coord.Deadlines(arrive=100, io=120)
    shardsafe.save(os.path.join(root, "c"), {"w": torch.zeros(4)}, timeout=deadlines)
    return said


def test_a_rank_late_to_arrive_is_named_after_seconds_and_the_save_still_commits(tmp_path: Any) -> None:
    env = {"SHARDSAFE_ARRIVAL_STALL_SECONDS": "1"}  # the default, 30 s, is what a real job would see
    r0, _ = check_ok(run_ranks(_late_rank, 2, str(tmp_path), timeout=120, env=env))
    stalls = [m for m in r0 if "not there yet" in m]
    assert len(stalls) == 1, r0
    assert "not there yet: [1]" in stalls[0] and "`if rank == 0:`" in stalls[0], stalls[0]
    assert "RankTimeoutError in" in stalls[0] and "call save() on every rank" in stalls[0], stalls[0]
    shardsafe.verify(tmp_path / "c")  # late, not failed
