"""Replicated tensors whose copies differ between ranks (no DDP wrapper, replicas that drifted apart) are
found before the commit (engine/replicas.py): the save is refused on every rank, naming the tensors and
the ranks, unless ``SHARDSAFE_REPLICA_CHECK`` says ``warn`` (logged, committed) or ``off``. Module buffers
that differ (DDP's BatchNorm statistics) are logged, never refused. An asynchronous save digests at the
call: changes made after it returns are no difference."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

import shardsafe

from harness import run_ranks


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.head = torch.nn.Linear(16, 64, bias=False)
        self.head.weight = self.embed.weight
        self.norm = torch.nn.BatchNorm1d(16)


def _scenarios(rank: int, world: int, root: str) -> dict[str, Any]:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logging.getLogger("shardsafe").addHandler(Keep())
    logging.getLogger("shardsafe").setLevel(logging.INFO)
    out: dict[str, Any] = {}

    def attempt(name: str, state: dict[str, Any], **kw: Any) -> None:
        del records[:]
        try:
            shardsafe.save(os.path.join(root, name), state, timeout=60, **kw)
            out[name] = "committed"
        except shardsafe.CheckpointError as err:
            out[name] = f"{type(err).__name__}: {err}"
        out[name + " log"] = [
            f"{r.levelname}: {r.getMessage()}" for r in records if r.name == "shardsafe.engine.replicas"
        ]

    torch.manual_seed(rank)  # no DDP: every rank initialises its own model
    model = _Tied()
    attempt("unsynced", {"model": model, "step": 1})
    os.environ["SHARDSAFE_REPLICA_CHECK"] = "warn"
    attempt("warned", {"model": model, "step": 1})
    os.environ["SHARDSAFE_REPLICA_CHECK"] = "off"
    attempt("off", {"model": model})
    del os.environ["SHARDSAFE_REPLICA_CHECK"]
    torch.manual_seed(0)  # the same parameters on every rank, BatchNorm statistics of each rank's batch
    model = _Tied()
    model.norm(torch.randn(8, 16, generator=torch.Generator().manual_seed(rank)))
    attempt("buffers", {"model": model})
    handle = shardsafe.async_save(os.path.join(root, "async"), {"model": model}, timeout=60)
    with torch.no_grad():
        model.head.weight.add_(rank + 1.0)  # after the call returned: not part of the checkpoint
    handle.wait()
    out["async"] = "committed"
    return out


def test_replicas_that_differ_are_refused_on_every_rank_naming_them(tmp_path: Path) -> None:
    outcomes = run_ranks(_scenarios, 2, str(tmp_path), timeout=180)
    for o in outcomes:
        assert o.ok, o
    r0, r1 = (o.result for o in outcomes)
    for r in (r0, r1):  # one outcome, on every rank, before the commit
        refused = r["unsynced"]
        assert refused.startswith("InconsistentRanksError") or refused.startswith("RemoteRankError"), refused
        assert "'model/embed.weight'" in refused and "'model/head.weight'" in refused, refused
        assert "2 different values, held by ranks [0] | [1]" in refused, refused
        assert "norm.running_mean" not in refused.split("Wrap")[0], refused  # buffers: not refused
        assert "SHARDSAFE_REPLICA_CHECK=warn" in refused, refused
        assert r["warned"] == r["off"] == r["buffers"] == r["async"] == "committed", r
    assert not (tmp_path / "unsynced").exists()
    assert any(line.startswith("WARNING") and "'model/embed.weight'" in line for line in r0["warned log"]), r0
    assert r0["off log"] == [] and r1["warned log"] == [], (r0, r1)
    assert any(line.startswith("INFO") and "norm.running_mean" in line for line in r0["buffers log"]), r0
    assert not any(line.startswith("WARNING") for line in r0["buffers log"]), r0
    saved = shardsafe.load(tmp_path / "async")["model"]  # the values at the call, the same on both ranks
    torch.manual_seed(0)
    assert torch.equal(saved["head.weight"], _Tied().head.weight)
