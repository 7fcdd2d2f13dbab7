"""The coordination layer on its own: agreements, failure propagation, deadlines, resync."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar

from shardsafe.coord import Deadlines, Empty, Message, Operation, Round
from shardsafe.engine.messages import Counts
from shardsafe.errors import CheckpointError, RankDesyncError, RankTimeoutError, RemoteRankError

from harness import check_ok, run_ranks

D = Deadlines(arrive=3.0, io=3.0)


@dataclass(frozen=True)
class Gathered(Message):
    """Rank 0's decision in these tests: every rank's counts, in rank order."""

    counts: list[list[int]]
    TYPES: ClassVar[dict[str, Any]] = {"counts": list}


ARRIVE = Round("arrive", Empty, Empty)
WRITE = Round("write", Counts, Gathered)
ID = Round("id", Counts, Empty)


def _collect(counts: dict[int, Counts]) -> Gathered:
    return Gathered([counts[r].counts for r in sorted(counts)])


def _guard_then_all(rank: int, world: int) -> dict[str, object]:
    out: dict[str, object] = {}
    if rank == 0:  # the classic mistake: only rank 0 calls
        t = time.monotonic()
        op = Operation.begin("save", "/ckpt/a", D.start())
        try:
            op.agree(ARRIVE, Empty())
        except RankTimeoutError as err:
            out["guard"] = (str(err), err.missing_ranks, time.monotonic() - t)
        finally:
            op.close()
    else:
        time.sleep(4.0)  # rank 1 is busy elsewhere while rank 0 times out
    op = Operation.begin("save", "/ckpt/b", D.start())  # then every rank calls: must meet
    op.agree(ARRIVE, Empty())
    got = op.agree(WRITE, Counts([rank]), _collect)
    out["payloads"] = got.counts
    out["seq"] = op.seq
    op.close()
    return out


def test_rank0_guard_times_out_naming_missing_rank_then_next_call_meets() -> None:
    r0, r1 = check_ok(run_ranks(_guard_then_all, 2, timeout=60))
    msg, missing, took = r0["guard"]
    assert missing == [1]
    assert "ranks [1] never arrived" in msg and "/ckpt/a" in msg and "on every rank" in msg
    assert took < 3.0 + 10
    assert r0["payloads"] == [[0], [1]] == r1["payloads"]


def _one_rank_fails(rank: int, world: int) -> tuple[str, float, int, str]:
    op = Operation.begin("save", "/ckpt", Deadlines(arrive=30, io=30).start())
    op.agree(ARRIVE, Empty())
    t = time.monotonic()
    try:
        if rank == 2:
            op.agree(WRITE, None, failure=OSError(28, "No space left on device"))
        op.agree(WRITE, Counts([rank]), _collect)
    except RemoteRankError as err:
        return ("remote", time.monotonic() - t, err.rank, str(err))
    except CheckpointError as err:
        return ("own", time.monotonic() - t, rank, str(err))
    finally:
        op.close()
    return ("none", 0.0, -1, "")


def test_failure_on_one_rank_reaches_every_rank_promptly() -> None:
    res = check_ok(run_ranks(_one_rank_fails, 3, timeout=60))
    assert res[2][0] == "own"
    for kind, took, who, msg in res[:2]:
        assert kind == "remote" and who == 2
        assert took < 5.0, took  # seconds, not the 30 s deadline
        assert "No space left on device" in msg and "'write'" in msg


def _desync(rank: int, world: int) -> str:
    op = Operation.begin("save" if rank == 0 else "load", "/ckpt", D.start())
    try:
        op.agree(ARRIVE, Empty())
    except RankDesyncError as err:
        return str(err)
    finally:
        op.close()
    return ""


def test_out_of_step_ranks_raise_on_both_with_what_each_did() -> None:
    for msg in check_ok(run_ranks(_desync, 2, timeout=60)):
        assert "rank 0: save('/ckpt')" in msg and "rank 1: load('/ckpt')" in msg


def test_single_process_needs_no_store() -> None:
    op = Operation.begin("save", "/x", D.start())
    assert op.world_size == 1 and op.single
    assert op.agree(WRITE, Counts([7]), _collect) == Gathered([[7]])
    assert op.agree(ID, Counts([1])) == Empty()
    op.close()
