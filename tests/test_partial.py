"""Partial state: weights-only checkpoints, strict and non-strict loads, missing or unexpected names."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import shardsafe

from harness import check_ok, run_ranks
from models import build, full_state, needs_fsdp2_on_cpu, train


def _weights_only(rank: int, world: int, path: str, strategy: str) -> dict[str, Any]:
    model, opt = build(strategy)
    train(model, opt, 1)
    shardsafe.save(path, {"model": model}, timeout=60)
    fresh, fopt = build(strategy, seed=7)
    before = full_state(fresh, fopt)
    out: dict[str, Any] = {}
    try:
        shardsafe.load(path, {"model": fresh, "optimizer": fopt}, timeout=60)
    except shardsafe.MissingKeysError as err:
        out["strict"] = (str(err), err.missing, err.available, isinstance(err, KeyError))
    untouched = full_state(fresh, fopt)
    out["untouched"] = all(torch.equal(before[k], untouched[k]) for k in before)
    shardsafe.load(path, {"model": fresh, "optimizer": fopt}, strict=False, timeout=60)
    after = full_state(fresh, fopt)
    saved = full_state(model, opt)
    out["model_loaded"] = all(torch.equal(after[k], saved[k]) for k in after if k.startswith("model/"))
    out["optimizer_empty"] = not any(k.startswith("opt/") for k in after)
    return out


@pytest.mark.parametrize(
    ("strategy", "world"), [("plain", 1), ("ddp", 2), pytest.param("fsdp", 2, marks=needs_fsdp2_on_cpu)]
)
def test_weights_only_checkpoint_with_optimizer_in_state(tmp_path: Any, strategy: str, world: int) -> None:
    path = str(tmp_path / "c")
    if world == 1:
        out = _weights_only(0, 1, path, strategy)
    else:
        out = check_ok(run_ranks(_weights_only, world, path, strategy, timeout=120))[0]
    msg, missing, available, is_keyerror = out["strict"]
    assert missing == ["optimizer"] and available == ["model"] and is_keyerror
    assert "lacks ['optimizer']" in msg and "holds ['model']" in msg and "strict=False" in msg
    assert out["untouched"], "strict=True must not modify anything before raising"
    assert out["model_loaded"] and out["optimizer_empty"]


class Wider(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 3)
        self.extra = torch.nn.Linear(3, 2)


class Narrow(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 3)


def test_missing_parameter_names_inside_a_module(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    src = Narrow()
    shardsafe.save(tmp_path / "c", {"model": src})
    dst = Wider()
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(shardsafe.MissingKeysError) as info:
        shardsafe.load(tmp_path / "c", {"model": dst})
    assert "model/extra.weight" in info.value.missing and "model/extra.bias" in info.value.missing
    assert all(torch.equal(before[k], v) for k, v in dst.state_dict().items())
    with caplog.at_level(logging.WARNING, logger="shardsafe"):
        shardsafe.load(tmp_path / "c", {"model": dst}, strict=False)
    assert torch.equal(dst.a.weight, src.a.weight)
    assert torch.equal(dst.extra.weight, before["extra.weight"])
    assert "model/extra.weight" in caplog.text


def test_unexpected_parameter_names_inside_a_module(tmp_path: Any) -> None:
    shardsafe.save(tmp_path / "c", {"model": Wider()})
    dst = Narrow()
    with pytest.raises(shardsafe.MissingKeysError) as info:
        shardsafe.load(tmp_path / "c", {"model": dst})
    assert any("unexpected extra.weight" in m for m in info.value.missing)
    shardsafe.load(tmp_path / "c", {"model": dst}, strict=False)


def test_shape_mismatch_names_the_key(tmp_path: Any) -> None:
    shardsafe.save(tmp_path / "c", {"model": torch.nn.Linear(3, 3)})
    with pytest.raises(shardsafe.CheckpointError, match=r"model/weight: shape mismatch.*\[3, 3\].*\[4, 3\]"):
        shardsafe.load(tmp_path / "c", {"model": torch.nn.Linear(3, 4)})


def test_unrequested_entries_are_returned(tmp_path: Any) -> None:
    """Small ones by default (a module is not: it stays on disk, tests/test_selective_load.py); every one
    with rest="all"."""
    shardsafe.save(tmp_path / "c", {"model": torch.nn.Linear(2, 2), "epoch": 3, "hist": [torch.ones(2), 1.5]})
    state: dict[str, Any] = {"epoch": 0}
    rest = shardsafe.load(tmp_path / "c", state)
    assert state["epoch"] == 3
    assert sorted(rest) == ["hist"]
    assert torch.equal(rest["hist"][0], torch.ones(2)) and rest["hist"][1] == 1.5
    assert sorted(shardsafe.load(tmp_path / "c", state, rest="all")) == ["hist", "model"]
