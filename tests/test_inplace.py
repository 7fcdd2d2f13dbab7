"""Loads go in place, as torch.distributed.checkpoint's do: tensors found in the caller's containers are
filled (same objects, storage, device, dtype), so ``{"model": model.state_dict()}`` loads the model;
mismatches raise before anything changes; Stateful objects go through state_dict/load_state_dict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe import CheckpointError

from harness import check_ok, run_ranks
from models import build, full_state, needs_fsdp2_on_cpu, train


def _linear(seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 3)


def _ptrs(sd: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Object id and storage address of each tensor (a DTensor's local shard)."""
    out = {}
    for k, v in sd.items():
        local = v.to_local() if hasattr(v, "to_local") else v
        out[k] = (id(v), local.data_ptr())
    return out


def test_state_dict_pattern_updates_the_model(tmp_path: Path) -> None:
    saved = _linear(0)
    shardsafe.save(tmp_path / "c", {"model": saved})  # saved as a module object
    model = _linear(1)
    sd = {"model": model.state_dict()}
    before = _ptrs(sd["model"])
    shardsafe.load(tmp_path / "c", sd)
    assert torch.equal(model.weight, saved.weight) and torch.equal(model.bias, saved.bias)
    assert _ptrs(sd["model"]) == before  # same objects, same storage


def test_nested_containers_filled_in_place_and_values_updated(tmp_path: Path) -> None:
    t1, t2, t3 = torch.arange(3.0), torch.ones(2, 2), torch.full((2,), 7, dtype=torch.int64)
    shardsafe.save(tmp_path / "c", {"buf": {"a": t1, "l": [t2, 3], "tup": (t3, "x"), "n": 5}})
    a, b, c = torch.zeros(3), torch.zeros(2, 2), torch.zeros(2, dtype=torch.int64)
    state: dict[str, Any] = {"buf": {"a": a, "l": [b, 0], "tup": (c, "y"), "n": 0}}
    inner, lst = state["buf"], state["buf"]["l"]
    shardsafe.load(tmp_path / "c", state)
    assert state["buf"] is inner and inner["l"] is lst  # containers updated, not replaced
    assert inner["a"] is a and lst[0] is b and inner["tup"][0] is c
    assert torch.equal(a, t1) and torch.equal(b, t2) and torch.equal(c, t3)
    assert lst[1] == 3 and inner["tup"][1] == "x" and inner["n"] == 5


def test_shape_mismatch_refused_before_anything_changes(tmp_path: Path) -> None:
    shardsafe.save(tmp_path / "c", {"a": torch.ones(2), "b": torch.ones(3), "step": 4})
    a, b = torch.zeros(2), torch.zeros(4)
    state: dict[str, Any] = {"a": a, "b": b, "step": 0}
    with pytest.raises(CheckpointError, match=r"b: shape mismatch.*\[3\].*\[4\]"):
        shardsafe.load(tmp_path / "c", state)
    assert torch.equal(a, torch.zeros(2)) and state["step"] == 0 and state["b"] is b


def test_dtype_mismatch_refused_unless_cast(tmp_path: Path) -> None:
    saved = _linear(0)
    shardsafe.save(tmp_path / "c", {"model": saved})
    model = _linear(1).to(torch.float64)
    before = model.weight.detach().clone()
    with pytest.raises(CheckpointError, match=r"model/weight: dtype mismatch.*float32.*float64.*cast=True"):
        shardsafe.load(tmp_path / "c", {"model": model})
    assert torch.equal(model.weight, before)
    shardsafe.load(tmp_path / "c", {"model": model}, cast=True)
    assert model.weight.dtype == torch.float64 and torch.equal(model.weight, saved.weight.double())


def test_a_tensor_where_the_checkpoint_holds_a_value_is_refused(tmp_path: Path) -> None:
    shardsafe.save(tmp_path / "c", {"x": {"t": 3}})
    with pytest.raises(CheckpointError, match=r"x/t: the state holds a tensor here, the checkpoint the value 3"):
        shardsafe.load(tmp_path / "c", {"x": {"t": torch.zeros(1)}})


def test_load_without_state_gives_cpu_tensors(tmp_path: Path) -> None:
    shardsafe.save(tmp_path / "c", {"model": _linear(0), "x": [torch.ones(2)]})
    out = shardsafe.load(tmp_path / "c", device="cpu")
    assert out["model"]["weight"].device.type == "cpu" and torch.equal(out["x"][0], torch.ones(2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_destinations_keep_their_device(tmp_path: Path) -> None:
    saved = _linear(0)
    shardsafe.save(tmp_path / "c", {"model": saved, "extra": torch.arange(4.0)})
    model = _linear(1).cuda()
    sd = {"model": model.state_dict()}
    before = _ptrs(sd["model"])
    shardsafe.load(tmp_path / "c", sd, strict=False)
    assert _ptrs(sd["model"]) == before and model.weight.device.type == "cuda"
    assert torch.equal(model.weight.cpu(), saved.weight)
    out = shardsafe.load(tmp_path / "c", device="cuda")
    assert out["extra"].device.type == "cuda" and torch.equal(out["extra"].cpu(), torch.arange(4.0))


class Counter:
    """DCP's Stateful protocol: state_dict() / load_state_dict(), holding a tensor and a plain value."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.hist = torch.full((3,), float(n))
        self.loaded: list[dict[str, Any]] = []

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "hist": self.hist}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.loaded.append(sd)
        self.n = sd["n"]


def test_stateful_objects_get_their_state_dict_filled_and_handed_back(tmp_path: Path) -> None:
    shardsafe.save(tmp_path / "c", {"counter": Counter(5)})
    counter = Counter(0)
    hist = counter.hist
    shardsafe.load(tmp_path / "c", {"counter": counter})
    assert counter.n == 5 and counter.hist is hist and torch.equal(hist, torch.full((3,), 5.0))
    (sd,) = counter.loaded
    assert sd["hist"] is hist


def test_optimizer_with_tensor_lr_round_trips_and_steps(tmp_path: Path) -> None:
    model = _linear(0)
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-3))
    train_linear(model, opt)
    shardsafe.save(tmp_path / "c", {"model": model, "optimizer": opt})
    model2 = _linear(1)
    opt2 = torch.optim.Adam(model2.parameters(), lr=torch.tensor(5e-2))
    shardsafe.load(tmp_path / "c", {"model": model2, "optimizer": opt2})
    lr = opt2.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.dtype == torch.float32 and float(lr) == pytest.approx(1e-3)
    state = opt2.state_dict()["state"][0]
    assert isinstance(state["step"], torch.Tensor) and isinstance(state["exp_avg"], torch.Tensor)
    train_linear(model2, opt2)  # step() works with what was loaded
    train_linear(model, opt)
    assert torch.equal(model.weight, model2.weight)


def train_linear(model: torch.nn.Linear, opt: torch.optim.Optimizer) -> None:
    loss = model(torch.ones(2, 4)).pow(2).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()


class RecordingSGD(torch.optim.SGD):
    """Keeps what load_state_dict was given (torch itself mangles strings in optimizer state)."""

    given: list[dict[str, Any]] = []

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.given.append(state_dict)
        super().load_state_dict(state_dict)


def test_a_string_equal_to_a_tensor_name_stays_a_string(tmp_path: Path) -> None:
    model = _linear(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_linear(model, opt)
    opt.state[model.weight]["label"] = "optimizer/state/weight/momentum_buffer"  # a real tensor's name
    shardsafe.save(tmp_path / "c", {"model": model, "optimizer": opt})
    model2 = _linear(0)
    opt2 = RecordingSGD(model2.parameters(), lr=0.1, momentum=0.9)
    shardsafe.load(tmp_path / "c", {"model": model2, "optimizer": opt2})
    state = opt2.given[-1]["state"][0]
    assert state["label"] == "optimizer/state/weight/momentum_buffer"
    assert isinstance(state["momentum_buffer"], torch.Tensor)


# ----------------------------------------------------------------------------- DDP and FSDP2, 2 ranks


def _state_dict_pattern(rank: int, world: int, path: str, strategy: str) -> dict[str, Any]:
    model, opt = build(strategy, seed=0)
    train(model, opt, 1)
    shardsafe.save(path, {"model": model, "optimizer": opt}, timeout=60)
    saved = {k: v for k, v in full_state(model, opt).items() if k.startswith("model/")}
    fresh, fopt = build(strategy, seed=5)
    out: dict[str, Any] = {}
    # a shape mismatch in one tensor: refused on every rank, nothing changed
    bad_sd = fresh.state_dict()
    first, last = next(iter(bad_sd)), list(bad_sd)[-1]
    bad_sd[last] = torch.zeros(1)
    before = {k: v for k, v in full_state(fresh, fopt).items() if k.startswith("model/")}
    try:
        shardsafe.load(path, {"model": bad_sd}, timeout=60)
    except CheckpointError as err:
        out["mismatch"] = (type(err).__name__, str(err))
    after = {k: v for k, v in full_state(fresh, fopt).items() if k.startswith("model/")}
    out["untouched"] = all(torch.equal(before[k], after[k]) for k in before)
    out["first"] = first
    # the DCP pattern: the state dict's tensors are the model's (DDP: "module." names; FSDP2: DTensors)
    sd = {"model": fresh.state_dict()}
    ptrs = _ptrs(sd["model"])
    shardsafe.load(path, sd, timeout=60)
    now = {k: v for k, v in full_state(fresh, fopt).items() if k.startswith("model/")}
    out["loaded"] = sorted(now) == sorted(saved) and all(torch.equal(now[k], saved[k]) for k in saved)
    out["identity"] = _ptrs(sd["model"]) == ptrs
    return out


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=needs_fsdp2_on_cpu)])
def test_state_dict_pattern_ddp_and_fsdp2(tmp_path: Path, strategy: str) -> None:
    outs = check_ok(run_ranks(_state_dict_pattern, 2, str(tmp_path / "c"), strategy, timeout=120))
    for out in outs:
        assert out["loaded"], "load into {'model': model.state_dict()} must update the model"
        assert out["identity"], "the state dict's tensors must stay the same objects and storage"
        assert out["untouched"], "a shape mismatch must be refused before anything changes"
    kinds = {o["mismatch"][0] for o in outs}
    assert kinds <= {"StateMismatchError", "RemoteRankError"} and "StateMismatchError" in kinds
    assert any("shape mismatch" in o["mismatch"][1] for o in outs)


def _fresh_optimizer_memory(rank: int, world: int, path: str) -> dict[str, Any]:
    import shardsafe.engine.read as read

    model, opt = build("fsdp", seed=0)
    train(model, opt, steps=1)
    shardsafe.save(path, {"model": model, "optim": opt})
    state_bytes = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    local_bytes = sum(
        t.to_local().numel() * t.element_size()
        for s in opt.state.values()
        for t in s.values()
        if hasattr(t, "to_local")
    )
    model2, opt2 = build("fsdp", seed=1)  # a fresh optimizer: its state is allocated by the load
    # Memory between this rank's shards of the optimizer state and the whole of it: the new tensors are
    # shards, so the load fits (counting them at their global size would refuse it).
    read.available_memory = lambda: (local_bytes + state_bytes) // 2  # type: ignore[assignment]
    shardsafe.load(path, {"model": model2, "optim": opt2})
    same = all(
        torch.equal(a.to_local(), b.to_local())
        for s1, s2 in zip(opt.state.values(), opt2.state.values(), strict=True)
        for a, b in zip(s1.values(), s2.values(), strict=True)
        if hasattr(a, "to_local")
    )
    return {"same": same, "local": local_bytes, "whole": state_bytes}


@needs_fsdp2_on_cpu
def test_new_sharded_optimizer_state_is_counted_at_its_local_size(tmp_path: Path) -> None:
    outs = check_ok(run_ranks(_fresh_optimizer_memory, 2, str(tmp_path / "c"), timeout=120))
    for out in outs:
        assert out["local"] < out["whole"]
        assert out["same"]
