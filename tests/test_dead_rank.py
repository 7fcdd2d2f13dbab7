"""A rank that dies inside a save is detected by its stopped heartbeat, well before the deadline."""

from __future__ import annotations

import time
from typing import Any

import shardsafe

from harness import run_ranks
from models import build, needs_fsdp2_on_cpu, train


def _save_with_death(rank: int, world: int, path: str) -> tuple[str, str, float]:
    model, opt = build("fsdp")
    train(model, opt, 1)
    t = time.monotonic()
    try:
        shardsafe.save(path, {"model": model, "optimizer": opt}, timeout=120)
    except Exception as err:
        return type(err).__name__, str(err), time.monotonic() - t
    return "none", "", time.monotonic() - t


@needs_fsdp2_on_cpu
def test_killed_rank_is_detected_by_heartbeat_not_deadline(tmp_path: Any) -> None:
    path = str(tmp_path / "c")
    out = run_ranks(
        _save_with_death,
        3,
        path,
        timeout=120,
        env={"SHARDSAFE_DEAD_AFTER": "3", "SHARDSAFE_FAULT": "save.write:rank=2:kill"},
    )
    assert out[2].exitcode == -9
    for o in out[:2]:
        assert o.result is not None, o
        kind, msg, took = o.result
        assert kind == "RankDeadError" and "rank 2" in msg, o.result
        assert took < 60, took  # the deadline is 120 s
    assert not any(p.name.startswith(".c.staging") for p in tmp_path.iterdir())
