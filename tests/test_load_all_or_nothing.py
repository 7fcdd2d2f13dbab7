"""A load that raises leaves the caller's state untouched: on every rank when any rank finds a problem
before the data is read (go/no-go through the store), for malformed optimizer and scheduler entries
(refused up front as corrupt), and, with the manager's verify mode, for damage anywhere in the data."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe import CheckpointManager, CorruptCheckpointError
from shardsafe.format.manifest import seal_manifest

from harness import run_ranks
from models import build, full_state, needs_fsdp2_on_cpu, train

Doc = dict[str, Any]

# ----------------------------------------------------------------------- one rank fails, none changes


def _one_rank_lacks_a_key(rank: int, world: int, path: str) -> dict[str, Any]:
    model, opt = build("fsdp", seed=0)
    train(model, opt, 1)
    shardsafe.save(path, {"model": model, "optimizer": opt, "step": 3}, timeout=60)
    fresh, fopt = build("fsdp", seed=5)
    train(fresh, fopt, 1)
    before = full_state(fresh, fopt)
    state: dict[str, Any] = {"model": fresh, "optimizer": fopt, "step": 0}
    if rank == 1:
        state["only_here"] = 1  # not in the checkpoint: strict=True refuses it on this rank alone
    out: dict[str, Any] = {}
    try:
        shardsafe.load(path, state, timeout=60)
    except shardsafe.CheckpointError as err:
        out["error"] = (type(err).__name__, str(err))
    after = full_state(fresh, fopt)
    out["untouched"] = sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)
    out["step"] = state["step"]
    return out


@needs_fsdp2_on_cpu
def test_strict_failure_on_one_rank_leaves_every_rank_untouched(tmp_path: Path) -> None:
    outs = run_ranks(_one_rank_lacks_a_key, 2, str(tmp_path / "c"), timeout=120)
    assert all(o.exitcode == 0 and o.error is None for o in outs), [(o.error_type, o.error) for o in outs]
    r0, r1 = outs[0].result, outs[1].result
    assert r1["error"][0] == "MissingKeysError" and "only_here" in r1["error"][1]
    assert r0["error"][0] == "RemoteRankError" and "rank 1" in r0["error"][1] and "only_here" in r0["error"][1]
    for out in (r0, r1):
        assert out["untouched"] and out["step"] == 0, "no rank may change its state when any rank refuses"


# ----------------------------------------------------------------------- malformed entries, refused up front


def _state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss = model(torch.ones(2, 4)).sum()
    loss.backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    return {"model": model, "optimizer": opt, "sched": sched, "step": 1}


def _set_item(node: Doc, key: str, value: Any) -> None:
    for pair in node["items"]:
        if pair[0] == key:
            pair[1] = value


def _groups(doc: Doc) -> Any:
    return dict(doc["objects"]["optimizer"]["value"]["items"])["param_groups"]


DAMAGE: dict[str, tuple[Callable[[Doc], None], str]] = {
    "optimizer state not a dict": (
        lambda d: _set_item(d["objects"]["optimizer"]["value"], "state", [1, 2]),
        "'state' is not a dict",
    ),
    "optimizer without param_groups": (
        lambda d: d["objects"]["optimizer"]["value"]["items"].pop(),
        "holds 'state' and 'param_groups'",
    ),
    "param group without params": (
        lambda d: _groups(d)[0]["items"].pop(),
        "'params' is not a list",
    ),
    "param group params not names": (
        lambda d: _set_item(_groups(d)[0], "params", [0, 1]),
        "'params' is not a list",
    ),
    "parameter state not a dict": (
        lambda d: _set_item(dict(d["objects"]["optimizer"]["value"]["items"])["state"], "weight", 3),
        "a parameter's state is not a dict",
    ),
    "scheduler entry not a dict": (
        lambda d: d["objects"]["sched"].update(value=[1, 2]),
        "sched: expected a state dict (a dict), found a list of 2",
    ),
    "module entry not a dict": (
        lambda d: d["objects"]["model"].update(value=7),
        "model: expected a module's state dict (a dict), found the value 7",
    ),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_malformed_entries_are_corrupt_and_change_nothing(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "c"
    shardsafe.save(path, _state(0))
    doc = json.loads((path / "MANIFEST.json").read_text())
    change, message = DAMAGE[damage]
    change(doc)
    (path / "MANIFEST.json").write_text(json.dumps(seal_manifest(doc)))
    state = _state(1)
    before = {k: v.clone() for k, v in state["model"].state_dict().items()}
    opt_before = repr(state["optimizer"].state_dict())
    sched_before = state["sched"].state_dict()
    with pytest.raises(CorruptCheckpointError) as info:
        shardsafe.load(path, state)
    assert message in str(info.value) and str(path) in str(info.value)
    assert all(torch.equal(before[k], v) for k, v in state["model"].state_dict().items())
    assert repr(state["optimizer"].state_dict()) == opt_before and state["sched"].state_dict() == sched_before


def test_a_short_data_file_is_found_before_any_parameter_changes(tmp_path: Path) -> None:
    path = tmp_path / "c"
    shardsafe.save(path, {"model": _state(0)["model"]})
    (f,) = [p for p in path.iterdir() if p.name.startswith("data-")]
    f.write_bytes(f.read_bytes()[:-4])  # the last parameter's bytes are gone
    model = _state(1)["model"]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        shardsafe.load(path, {"model": model})
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# ----------------------------------------------------------------------- the manager's verify mode


def _flip_last_byte(path: Path) -> None:
    """Damage the data of ``x``, the last tensor written, after the model's."""
    (f,) = sorted(p for p in path.iterdir() if p.name.startswith("data-"))
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF
    f.write_bytes(bytes(raw))


def _mstate(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {"model": torch.nn.Linear(64, 64), "x": torch.randn(1000), "step": 0}


def test_resume_verify_mode_changes_nothing_unless_the_checkpoint_verified(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=None, save_on_signals=()) as mgr:
        for step in (1, 2, 3):
            state = _mstate(step)
            state["step"] = step
            mgr.save(step, state)
    _flip_last_byte(tmp_path / "step-00000003")
    fresh = _mstate(0)
    with CheckpointManager(tmp_path, save_on_signals=()) as mgr:  # the newest is damaged: the previous one
        assert mgr.resume(fresh, verify=True) == 2
    assert fresh["step"] == 2 and torch.equal(fresh["model"].weight, _mstate(2)["model"].weight)
    for step in (1, 2):
        _flip_last_byte(tmp_path / f"step-{step:08d}")
    fresh = _mstate(0)
    before = {k: v.clone() for k, v in fresh["model"].state_dict().items()}
    mgr = CheckpointManager(tmp_path, save_on_signals=(), verify_on_resume=True)
    with mgr, pytest.raises(CorruptCheckpointError, match="The state is untouched") as info:
        mgr.resume(fresh)
    assert all(f"step-{s:08d}" in str(info.value) for s in (1, 2, 3))
    assert all(torch.equal(before[k], v) for k, v in fresh["model"].state_dict().items()) and fresh["step"] == 0


def test_optimizer_state_the_optimizer_refuses_is_found_before_anything_changes(tmp_path: Path) -> None:
    """Well-formed typed JSON that the optimizer itself rejects (Adam's ``step`` as a string) is found
    by a trial load while planning, not after the model was filled."""
    from shardsafe.format.manifest import seal_manifest

    def state(seed: int) -> dict[str, Any]:
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 3)
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        return {"model": model, "optimizer": opt}

    shardsafe.save(tmp_path / "c", state(0))
    manifest = tmp_path / "c" / "MANIFEST.json"
    doc = json.loads(manifest.read_text())
    params = dict(dict(doc["objects"]["optimizer"]["value"]["items"])["state"]["items"])
    _set_item(params["weight"], "step", "V1")
    manifest.write_text(json.dumps(seal_manifest(doc)))
    target = state(1)
    before = {k: v.clone() for k, v in target["model"].state_dict().items()}
    opt_before = repr(target["optimizer"].state_dict())
    with pytest.raises(CorruptCheckpointError, match=r"the optimizer \(Adam\) refuses the saved state"):
        shardsafe.load(tmp_path / "c", target)
    assert all(torch.equal(before[k], v) for k, v in target["model"].state_dict().items())
    assert repr(target["optimizer"].state_dict()) == opt_before
