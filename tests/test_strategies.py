"""Every strategy and every resharding pair, bitwise: plain, DDP and FSDP2 on 1-4 ranks (gloo, CPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import shardsafe

from harness import check_ok, run_ranks
from models import assert_same, build, full_state, needs_fsdp2_on_cpu, train


def _save(rank: int, world: int, path: str, strategy: str) -> dict[str, Any]:
    model, opt = build(strategy, seed=0)
    train(model, opt, 2)
    shardsafe.save(path, {"model": model, "optimizer": opt, "step": 2}, timeout=60)
    return full_state(model, opt)


def _load(rank: int, world: int, path: str, strategy: str) -> dict[str, Any]:
    model, opt = build(strategy, seed=123)  # different init: everything must come from the checkpoint
    state: dict[str, Any] = {"model": model, "optimizer": opt, "step": 0}
    shardsafe.load(path, state, timeout=60)
    assert state["step"] == 2
    return full_state(model, opt)


def _save_or_load(kind: str, strategy: str, world: int, path: str) -> dict[str, Any]:
    fn = _save if kind == "save" else _load
    if strategy == "plain":
        return fn(0, 1, path, "plain")
    return check_ok(run_ranks(fn, world, path, strategy, timeout=120))[0]


PAIRS = [
    # (save strategy, save world, load strategy, load world)
    pytest.param("fsdp", 2, "plain", 1, marks=needs_fsdp2_on_cpu),
    ("plain", 1, "fsdp", 2),
    pytest.param("fsdp", 2, "fsdp", 3, marks=needs_fsdp2_on_cpu),
    pytest.param("fsdp", 4, "fsdp", 2, marks=needs_fsdp2_on_cpu),
    ("ddp", 2, "fsdp", 2),
    pytest.param("fsdp", 2, "ddp", 2, marks=needs_fsdp2_on_cpu),
    ("ddp", 2, "plain", 1),
]


@pytest.mark.parametrize(("s_strat", "s_world", "l_strat", "l_world"), PAIRS)
def test_reshard(tmp_path: Any, s_strat: str, s_world: int, l_strat: str, l_world: int) -> None:
    path = str(tmp_path / "ckpt")
    saved = _save_or_load("save", s_strat, s_world, path)
    shardsafe.verify(path)
    loaded = _save_or_load("load", l_strat, l_world, path)
    assert_same(saved, loaded)
    # and the whole checkpoint, in one plain process, as CPU tensors
    whole = shardsafe.load(path)
    for k, v in saved.items():
        if k.startswith("model/"):
            assert torch.equal(whole["model"][k[len("model/") :]], v), k


def _ddp_writers(rank: int, world: int, path: str) -> list[str]:
    model, opt = build("ddp")
    train(model, opt, 1)
    shardsafe.save(path, {"model": model, "optimizer": opt}, timeout=60)
    return []


def test_ddp_writes_each_replicated_tensor_once_spread_over_ranks(tmp_path: Any) -> None:
    path = str(tmp_path / "ckpt")
    check_ok(run_ranks(_ddp_writers, 2, path, timeout=120))
    info = shardsafe.inspect(path)
    assert info.world_size == 2 and info.strategy == "ddp"
    writers = {f.split("-")[1] for f in info.files}
    assert writers == {"00000", "00001"}, info.files  # both ranks wrote a share
    tensors = [e for e in info.entries if e.kind == "tensor"]
    assert all(e.chunks == 1 for e in tensors)  # written once, not once per rank


def _fsdp_no_gather(rank: int, world: int, path: str) -> None:
    model, opt = build("fsdp")
    train(model, opt, 1)
    shardsafe.save(path, {"model": model, "optimizer": opt}, timeout=60)


@needs_fsdp2_on_cpu
def test_fsdp_each_rank_writes_its_own_shards(tmp_path: Any) -> None:
    path = str(tmp_path / "ckpt")
    check_ok(run_ranks(_fsdp_no_gather, 2, path, timeout=120))
    info = shardsafe.inspect(path)
    assert info.strategy == "fsdp"
    by_name = {e.name: e for e in info.entries}
    assert by_name["model/blocks.0.lin.weight"].chunks == 2  # 7 rows: 4 + 3, one chunk per rank
    assert by_name["optimizer/state/blocks.0.lin.weight/exp_avg"].chunks == 2
