"""FSDP1 (FullyShardedDataParallel, Lightning Fabric's ``strategy="fsdp"``) on CPU ranks (gloo), with
``use_orig_params`` True and False: save/load bitwise, reshards to and from plain, FSDP2 and FSDP1 on other
world sizes, optimizer state included; each rank writes only its own shard and no collective runs; a
weights-only checkpoint loaded with an optimizer asks is refused by name, or loads the model only."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.state.fsdp1 import flat_boxes
from test_no_collectives import _no_collectives

from harness import check_ok, run_ranks
from models import assert_same, build, full_state, needs_fsdp2_on_cpu, train

FSDP1 = ["fsdp1", "fsdp1-flat"]  # use_orig_params=True (Fabric's default) / False


def test_flat_ranges_become_boxes_that_tile_them_in_order() -> None:
    rng = random.Random(0)
    shapes = [(), (7,), (5, 7), (3, 4, 5), (2, 1, 3, 4), (4, 0)]
    for shape in shapes:
        numel = math.prod(shape)
        for _ in range(40):
            lo = rng.randrange(numel + 1)
            hi = rng.randrange(lo, numel + 1)
            flat = torch.arange(numel)
            full = flat.view(shape)
            got = torch.full((numel,), -1)
            pos = 0
            for offsets, sizes, start in flat_boxes(shape, lo, hi):
                assert start == pos  # in order, contiguous
                n = math.prod(sizes)
                box = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
                assert torch.equal(box.reshape(-1), flat[lo + start : lo + start + n]), (shape, lo, hi)
                got[lo + start : lo + start + n] = box.reshape(-1)
                pos += n
            assert pos == hi - lo and torch.equal(got[lo:hi], flat[lo:hi]), (shape, lo, hi)
            assert len(flat_boxes(shape, lo, hi)) <= 2 * max(1, len(shape)) - 1 if hi > lo else True


def _storage(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[tuple[int, int]]:
    """(id, data pointer) of every flat parameter and optimizer state tensor."""
    tensors = [*model.parameters(), *(v for st in opt.state.values() for v in st.values())]
    return [(id(t), t.data_ptr()) for t in tensors if isinstance(t, torch.Tensor) and t.numel() > 1]


def _save_then_reload(rank: int, world: int, path: str, strategy: str) -> dict[str, Any]:
    model, opt = build(strategy, seed=0)
    train(model, opt, 2)
    state = {"model": model, "optimizer": opt, "step": 2}
    model2, opt2 = build(strategy, seed=123)
    train(model2, opt2, 1, start=7)  # it has optimizer state of its own: filled in place
    where = _storage(model2, opt2)
    loaded: dict[str, Any] = {"model": model2, "optimizer": opt2, "step": 0}
    with _no_collectives():  # no gather of the state, no collective at all
        shardsafe.save(path, state, timeout=60)
        shardsafe.load(path, loaded, timeout=60)
    in_place = _storage(model2, opt2) == where
    train(model, opt, 1, start=2)  # both go on identically
    train(model2, opt2, 1, start=2)
    out = {"saved": full_state(model, opt), "loaded": full_state(model2, opt2), "step": loaded["step"]}
    return {**out, "in_place": in_place and len(where) > 4}


def _load(rank: int, world: int, path: str, strategy: str) -> dict[str, Any]:
    model, opt = build(strategy, seed=123)
    shardsafe.load(path, {"model": model, "optimizer": opt}, timeout=60)
    return full_state(model, opt)


@pytest.mark.parametrize("strategy", FSDP1)
def test_fsdp1_round_trip_and_reshards_to_plain_and_fsdp2(tmp_path: Any, strategy: str) -> None:
    path = str(tmp_path / "ckpt")
    results = check_ok(run_ranks(_save_then_reload, 2, path, strategy, timeout=180))
    assert results[0]["step"] == 2
    assert all(r["in_place"] for r in results)  # same flat shards and optimizer state tensors, same storage
    assert_same(results[0]["saved"], results[0]["loaded"])
    shardsafe.verify(path)
    info = shardsafe.inspect(path)
    assert info.world_size == 2 and info.strategy == "fsdp"
    assert {f.split("-")[1] for f in info.files} == {"00000", "00001"}  # both ranks wrote their shard
    # Every parameter and state tensor is stored once (no replica, no gathered copy): the bytes
    # stored equal the bytes of the model and optimizer state.
    tensors = [e for e in info.entries if e.kind == "tensor"]
    model_bytes = sum(e.nbytes for e in tensors if e.name.startswith("model/"))
    assert model_bytes == sum(p.numel() * 4 for p in build("plain")[0].state_dict().values())
    # the state of the training run before the extra step, as saved
    saved = check_ok(run_ranks(_load, 3, path, "fsdp", timeout=180))[0]  # FSDP1 2 -> FSDP2 3
    model, opt = build("plain", seed=5)  # FSDP1 2 -> one plain process
    shardsafe.load(path, {"model": model, "optimizer": opt})
    assert_same(saved, full_state(model, opt))
    assert len(opt.state) == 6 and all(int(s["step"]) == 2 for s in opt.state.values())


def _other_sharding(strategy: str, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """FSDP1 with SHARD_GRAD_OP (use_orig_params=False) or NO_SHARD (True), one unit per block."""
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from models import Block, Net

    torch.manual_seed(seed)
    model = FullyShardedDataParallel(
        Net(),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=ShardingStrategy.SHARD_GRAD_OP if strategy == "zero2" else ShardingStrategy.NO_SHARD,
        use_orig_params=strategy == "noshard",
        device_id=torch.device("cpu"),
    )
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _fsdp2_save_fsdp1_load(rank: int, world: int, path: str) -> dict[str, Any]:
    model, opt = build("fsdp", seed=0)
    train(model, opt, 2)
    shardsafe.save(path, {"model": model, "optimizer": opt}, timeout=60)
    out = {"fsdp": full_state(model, opt)}
    for strategy in [*FSDP1, "zero2", "noshard"]:
        m, o = build(strategy, seed=9) if strategy in FSDP1 else _other_sharding(strategy, 9)
        shardsafe.load(path, {"model": m, "optimizer": o}, timeout=60)
        out[strategy] = full_state(m, o)
        if strategy == "noshard":  # and a NO_SHARD save: every rank holds everything, written once
            train(m, o, 1, start=2)
            shardsafe.save(f"{path}-noshard", {"model": m, "optimizer": o}, timeout=60)
            out["noshard-trained"] = full_state(m, o)
    # Parameters of one FSDP1 unit with different Adam steps (one had no gradient for a while): a flat
    # parameter (use_orig_params=False) holds one step, so the load is refused before anything changes.
    opt.state[dict(model.named_parameters())["blocks.0.lin.bias"]]["step"].add_(3)
    shardsafe.save(f"{path}-steps", {"model": model, "optimizer": opt}, timeout=60)
    out["fsdp-steps"] = full_state(model, opt)
    m, o = build("fsdp1-flat", seed=9)
    train(m, o, 1)
    before = full_state(m, o)
    try:
        shardsafe.load(f"{path}-steps", {"model": m, "optimizer": o}, timeout=60)
    except shardsafe.CheckpointError as err:
        out["steps-error"] = str(err)
    after = full_state(m, o)
    out["steps-untouched"] = all(torch.equal(before[k], after[k]) for k in before)
    m, o = build("fsdp1", seed=9)  # use_orig_params=True: a state per parameter, loads
    shardsafe.load(f"{path}-steps", {"model": m, "optimizer": o}, timeout=60)
    out["fsdp1-steps"] = full_state(m, o)
    return out


@needs_fsdp2_on_cpu
def test_fsdp2_checkpoint_loads_into_fsdp1(tmp_path: Any) -> None:
    """Into FSDP1 with either use_orig_params, and with SHARD_GRAD_OP and NO_SHARD."""
    path = str(tmp_path / "ckpt")
    results = check_ok(run_ranks(_fsdp2_save_fsdp1_load, 2, path, timeout=180))
    for strategy in [*FSDP1, "zero2", "noshard"]:
        assert_same(results[0]["fsdp"], results[0][strategy])
    for r in results:
        assert "'step' differs between ['blocks.0.lin.weight', 'blocks.0.lin.bias']" in r["steps-error"]
        assert "use_orig_params=True" in r["steps-error"] and r["steps-untouched"]
    assert_same(results[0]["fsdp-steps"], results[0]["fsdp1-steps"])
    model, opt = build("plain", seed=5)
    shardsafe.load(f"{path}-noshard", {"model": model, "optimizer": opt})
    assert_same(results[0]["noshard-trained"], full_state(model, opt))
    info = shardsafe.inspect(f"{path}-noshard")
    assert all(e.chunks == 1 for e in info.entries if e.kind == "tensor")  # replicated: written once


def _weights_only(rank: int, world: int, path: str) -> dict[str, Any]:
    model, opt = build("fsdp1", seed=0)
    train(model, opt, 1)
    shardsafe.save(path, {"model": model}, timeout=60)  # weights only
    saved = full_state(model, opt)
    model2, opt2 = build("fsdp1", seed=4)
    train(model2, opt2, 1)
    before = full_state(model2, opt2)
    out: dict[str, Any] = {}
    try:
        shardsafe.load(path, {"model": model2, "optimizer": opt2}, timeout=60)
    except shardsafe.MissingKeysError as err:
        out["error"] = (str(err), err.missing, err.available, isinstance(err, KeyError))
    out["untouched"] = all(torch.equal(before[k], v) for k, v in full_state(model2, opt2).items())
    shardsafe.load(path, {"model": model2, "optimizer": opt2}, strict=False, timeout=60)
    after = full_state(model2, opt2)
    out["model_loaded"] = all(torch.equal(saved[k], after[k]) for k in saved if k.startswith("model/"))
    out["optimizer_kept"] = all(torch.equal(before[k], after[k]) for k in before if k.startswith("opt/"))
    # FSDP1's own sharded state dict (ShardedTensors, local shards with global offsets) as a plain entry
    from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType

    with FullyShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sharded = model.state_dict()
    assert type(sharded["blocks.0.lin.weight"]).__name__ == "ShardedTensor"
    shardsafe.save(f"{path}-sharded-sd", {"sd": sharded}, timeout=60)
    out["saved"] = saved
    saved_sd = {k: v for k, v in sharded.items() if hasattr(v, "local_shards")}  # the saved model's shards
    # DCP's pattern for FSDP1: the state dict FSDP1 returns holds copies (ShardedTensors here); they are
    # filled in place (same objects, same local shards), and reach the model through load_state_dict.
    model3, opt3 = build("fsdp1", seed=7)
    before = full_state(model3, opt3)
    with FullyShardedDataParallel.state_dict_type(model3, StateDictType.SHARDED_STATE_DICT):
        sd = model3.state_dict()
    objects = dict(sd)
    shards = [(k, s.tensor, s.tensor.data_ptr()) for k in saved_sd for s in sd[k].local_shards()]
    shardsafe.load(path, {"model": sd}, timeout=60)
    now = [(k, s.tensor, s.tensor.data_ptr()) for k in saved_sd for s in sd[k].local_shards()]
    out["sd_in_place"] = all(sd[k] is v for k, v in objects.items()) and all(
        a[1] is b[1] and a[2] == b[2] for a, b in zip(shards, now, strict=True)
    )
    out["sd_filled"] = all(  # each local shard holds the saved model's values, as FSDP1 chunks them
        torch.equal(mine.tensor, theirs.tensor)
        for k in saved_sd
        for mine, theirs in zip(sd[k].local_shards(), saved_sd[k].local_shards(), strict=True)
    )
    out["model_not_yet"] = all(torch.equal(before[k], v) for k, v in full_state(model3, opt3).items())
    with FullyShardedDataParallel.state_dict_type(model3, StateDictType.SHARDED_STATE_DICT):
        model3.load_state_dict(sd)
    out["model_after"] = full_state(model3, opt3)
    return out


def test_fsdp1_weights_only_checkpoint_with_optimizer_requested(tmp_path: Any) -> None:
    """The seed scenario: Fabric's FSDP weights-only checkpoint crashed with KeyError: 'optimizer_states'."""
    path = str(tmp_path / "weights")
    r = check_ok(run_ranks(_weights_only, 2, path, timeout=180))[0]
    message, missing, available, is_key_error = r["error"]
    assert missing == ["optimizer"] and available == ["model"] and is_key_error
    assert "lacks ['optimizer']" in message and "holds ['model']" in message and "strict=False" in message
    assert r["untouched"] and r["model_loaded"] and r["optimizer_kept"]
    assert r["sd_in_place"] and r["sd_filled"] and r["model_not_yet"]
    assert all(torch.equal(v, r["model_after"][k]) for k, v in r["saved"].items() if k.startswith("model/"))
    whole = shardsafe.load(f"{path}-sharded-sd")["sd"]
    assert {f"model/{k}" for k in whole} == {k for k in r["saved"] if k.startswith("model/")}
    assert all(torch.equal(v, r["saved"][f"model/{k}"]) for k, v in whole.items())


class Tied(torch.nn.Module):
    """Tied embedding/output weights, and a layer FSDP1 is told to ignore (a plain parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(7, 5)
        self.mid = torch.nn.Linear(5, 5)
        self.out = torch.nn.Linear(5, 7, bias=False)
        self.out.weight = self.emb.weight
        self.side = torch.nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.side(self.mid(self.emb(x))))


def _tied_state(uop: bool, seed: int) -> dict[str, Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel

    torch.manual_seed(seed)
    base = Tied()
    model = FullyShardedDataParallel(
        base, use_orig_params=uop, device_id=torch.device("cpu"), ignored_modules=[base.side]
    )
    ema = torch.nn.Linear(3, 3)  # a second module: parameter names become <key>.<name>
    opt = torch.optim.AdamW([*model.parameters(), *ema.parameters()], lr=0.01)
    return {"model": model, "ema": ema, "optim": opt}


def _tied_round_trips(rank: int, world: int, root: str) -> None:
    for uop in (True, False):
        state = _tied_state(uop, 0)
        state["model"](torch.arange(7) % 5).pow(2).mean().backward()
        state["ema"](torch.ones(2, 3)).sum().backward()
        state["optim"].step()
        shardsafe.save(f"{root}/{uop}-a", state, timeout=60)
        again = _tied_state(uop, 1)
        shardsafe.load(f"{root}/{uop}-a", again, timeout=60)
        shardsafe.save(f"{root}/{uop}-b", again, timeout=60)  # what was loaded, saved again


def test_fsdp1_tied_weights_ignored_modules_and_two_modules(tmp_path: Any) -> None:
    check_ok(run_ranks(_tied_round_trips, 2, str(tmp_path), timeout=180))
    for uop in (True, False):
        a, b = shardsafe.load(tmp_path / f"{uop}-a"), shardsafe.load(tmp_path / f"{uop}-b")
        assert sorted(a["model"]) == ["emb.weight", "mid.bias", "mid.weight", "out.weight", "side.bias", "side.weight"]
        assert torch.equal(a["model"]["emb.weight"], a["model"]["out.weight"])
        assert sorted(a["optim"]["state"]) == sorted(b["optim"]["state"]) and len(a["optim"]["state"]) == 7
        for name, st in a["optim"]["state"].items():
            for k, v in st.items():
                assert torch.equal(v, b["optim"]["state"][name][k]), (uop, name, k)
        for k, v in a["model"].items():
            assert torch.equal(v, b["model"][k]), (uop, k)
        model, ema = Tied(), torch.nn.Linear(3, 3)  # and into plain modules
        opt = torch.optim.AdamW([*model.parameters(), *ema.parameters()], lr=0.01)
        shardsafe.load(tmp_path / f"{uop}-a", {"model": model, "ema": ema, "optim": opt})
        assert all(torch.equal(v, a["model"][k]) for k, v in model.state_dict().items())
