"""``async_save(..., staging="background")``: the call returns before copying, and the checkpoint holds
the values at the call or the save fails on every rank (:class:`TornSnapshotError`), never a torn
snapshot. Staging is slowed down deterministically through ``staging.before_background_copy``. Also:
a failed background save surfaces exactly once, at ``wait()`` or at the next call."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import torch
from torch import nn

import shardsafe
from shardsafe.engine import save as save_module
from shardsafe.engine import staging, stepgate
from shardsafe.state import flatten as flatten_module

from harness import check_ok, run_ranks
from models import assert_same, build, full_state, needs_fsdp2_on_cpu, train


def _slow(seconds: float) -> None:
    staging.before_background_copy = lambda _name: time.sleep(seconds)


# ------------------------------------------------------------------ the optimizer step right after


def _step_right_after(rank: int, world: int, path: str, strategy: str) -> float:
    model, opt = build(strategy)
    train(model, opt, 2)
    before = full_state(model, opt)
    _slow(0.02)  # every copy waits: the steps below come while staging runs
    handle = shardsafe.async_save(path, {"model": model, "optimizer": opt}, timeout=60, staging="background")
    assert not handle.staged()
    train(model, opt, 2, start=2)  # forward (DDP broadcasts buffers), backward, step: at once
    handle.wait()
    assert handle.staged() and handle.exception() is None
    assert handle.job.background is not None
    waited = handle.job.background.waited
    staging.before_background_copy = None
    fresh, fopt = build(strategy, seed=5)
    shardsafe.load(path, {"model": fresh, "optimizer": fopt}, timeout=60)
    assert_same(before, full_state(fresh, fopt))  # bit for bit the values at the call
    return waited


@pytest.mark.parametrize("strategy", ["ddp", "fsdp1", pytest.param("fsdp", marks=needs_fsdp2_on_cpu)])
def test_optimizer_step_right_after_the_call_waits_and_the_checkpoint_holds_the_call(
    tmp_path: Any, strategy: str
) -> None:
    waited = check_ok(run_ranks(_step_right_after, 2, str(tmp_path / "c"), strategy, timeout=90))
    assert sum(waited) > 0  # the steps did wait for their tensors (not a lucky ordering)


def test_forward_through_batchnorm_right_after_the_call_keeps_the_buffers(tmp_path: Any, monkeypatch: Any) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(16, 8)
    model(x).sum().backward()
    opt.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setattr(staging, "before_background_copy", lambda _name: time.sleep(0.05))
    path = str(tmp_path / "c")
    handle = shardsafe.async_save(path, {"model": model, "optimizer": opt}, staging="background")
    for _ in range(3):
        model(x * 3 + 1)  # train mode: the running statistics change (and their version counter does not)
    assert not torch.equal(model[1].running_mean, before["1.running_mean"])
    handle.wait()
    loaded = shardsafe.load(path)["model"]
    for k, v in before.items():
        assert torch.equal(loaded[k], v), k


def test_the_gate_is_installed_once_and_never_removed_under_a_running_step(tmp_path: Any, monkeypatch: Any) -> None:
    """Removing a step pre-hook from the staging thread while ``step()`` iterates the hooks would raise
    "OrderedDict mutated during iteration" in the training thread: one gate common to every optimizer,
    kept, asking no staging once the saves are over; the user's own hooks still run."""
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    model, opt = build("plain")
    train(model, opt, 1)
    seen: list[int] = []
    monkeypatch.setattr(staging, "before_background_copy", lambda _name: time.sleep(0.01))
    for i in range(3):
        handle = shardsafe.async_save(str(tmp_path / f"c{i}"), {"model": model, "optimizer": opt}, staging="background")
        if i == 0:
            opt.register_step_pre_hook(lambda *_: seen.append(1))  # a hook of the user's, after the gate
        train(model, opt, 2, start=2 * i)
        handle.wait()
    assert sum(hook is stepgate._hook for hook in _global_optimizer_pre_hooks.values()) == 1
    assert len(opt._optimizer_step_pre_hooks) == 1 and len(seen) == 6
    assert stepgate.armed() == 0


def _fused(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return model, opt


def test_a_fused_optimizer_outside_the_state_waits_for_its_tensors(tmp_path: Any, monkeypatch: Any) -> None:
    """A fused step moves no version counter: outside the state (the model saved alone, or with
    ``opt.state_dict()``) it went unseen and the checkpoint held the parameters after the step. The
    step gate common to every optimizer holds it until its tensors are copied; an optimizer whose
    tensors the save does not hold is not held at all."""
    model, opt = _fused()
    other, other_opt = _fused(seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: v.clone() for k, v in opt.state[model[0].weight].items()}
    go = threading.Event()
    monkeypatch.setattr(staging, "before_background_copy", lambda _name: (go.wait(20), time.sleep(0.005)))
    path = str(tmp_path / "c")
    handle = shardsafe.async_save(path, {"model": model, "optimizer": opt.state_dict()}, staging="background")
    other(torch.randn(4, 8)).sum().backward()
    other_opt.step()  # its tensors are not the save's: not held (the copies are, until go)
    assert not handle.staged()
    model(torch.randn(4, 8)).sum().backward()
    go.set()
    opt.step()
    handle.wait()
    assert handle.job.background is not None and handle.job.background.waited > 0
    loaded = shardsafe.load(path)
    for k, v in before.items():
        assert torch.equal(loaded["model"][k], v), k
    for k, v in moments.items():
        assert torch.equal(loaded["optimizer"]["state"][0][k], v), k


def test_a_step_past_the_deadline_fails_the_save_naming_the_optimizer(tmp_path: Any, monkeypatch: Any) -> None:
    """The gate waits until the save's deadline; a step that then goes on may change what is not copied
    yet without a trace (fused): the save fails with TornSnapshotError, and the committed checkpoint stays."""
    model, opt = _fused()
    path = str(tmp_path / "c")
    shardsafe.save(path, {"model": model})
    go = threading.Event()
    monkeypatch.setattr(staging, "before_background_copy", lambda _name: go.wait(20))
    handle = shardsafe.async_save(path, {"model": model}, staging="background", timeout=2, overwrite=True)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()  # waits about 2 s, then goes on
    go.set()
    with pytest.raises(shardsafe.TornSnapshotError, match="optimizer 'AdamW outside the state' stepped"):
        handle.wait()
    shardsafe.verify(path)


def test_a_failing_step_gate_fails_the_save_not_the_step(tmp_path: Any, monkeypatch: Any) -> None:
    """The gate runs in every optimizer's step: if it cannot match an optimizer to the save's tensors,
    the training step goes on and the save (which can no longer know what the step wrote) fails."""
    from shardsafe.engine import sources

    model, opt = _fused()

    def broken(_opt: Any) -> Any:
        raise ValueError("odd optimizer state")

    monkeypatch.setattr(sources, "optimizer_keys", broken)
    go = threading.Event()
    monkeypatch.setattr(staging, "before_background_copy", lambda _name: go.wait(20))
    handle = shardsafe.async_save(str(tmp_path / "c"), {"model": model}, staging="background")
    model(torch.randn(4, 8)).sum().backward()
    opt.step()  # does not raise
    go.set()
    with pytest.raises(shardsafe.TornSnapshotError, match=r"could not match an optimizer \(AdamW\).*odd optimizer"):
        handle.wait()


_FREED = """
import sys, tempfile, torch, shardsafe
for mode in ("save", "blocking", "background"):
    t = torch.randn(1 << 20)
    t.untyped_storage().resize_(0)  # as FSDP-style code frees what it will gather again
    path = tempfile.mkdtemp() + "/c"
    try:
        if mode == "save":
            shardsafe.save(path, {"t": t})
        else:
            shardsafe.async_save(path, {"t": t}, staging=mode).wait()
        print(mode, "committed", flush=True)
    except shardsafe.CheckpointError as err:
        print(mode, type(err).__name__, str(err).splitlines()[0], flush=True)
"""


def test_a_tensor_without_memory_is_refused_by_name_on_every_path(tmp_path: Any) -> None:
    """A tensor whose storage was freed has no bytes to save: a synchronous save wrote whatever lay at
    its null pointer and committed it, an asynchronous one crashed the process (SIGSEGV) reading it. In
    a child process, so that a crash fails this test and not the run."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(shardsafe.__file__)), "TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", _FREED], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr[-2000:])
    lines = out.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["save", "blocking", "background"], out.stdout
    for line in lines:
        assert "InvalidArgumentError tensor 't' has no memory" in line, line


# ------------------------------------------------------------------ the call returns before the start


def _returns_before_the_others_arrive(rank: int, world: int, path: str, signal: str) -> bool:
    """Rank 1 calls ``async_save`` only once rank 0's call has returned: a call that waited for every
    rank (the save's start is agreed among them) would never return, and the save would time out."""
    model, opt = build("ddp")
    train(model, opt, 1)
    before = full_state(model, opt)
    if rank == 0:
        handle = shardsafe.async_save(path, {"model": model, "optimizer": opt}, timeout=20, staging="background")
        with open(signal, "w") as f:
            f.write("returned")
    else:
        deadline = time.monotonic() + 20
        while not os.path.exists(signal) and time.monotonic() < deadline:
            time.sleep(0.01)
        handle = shardsafe.async_save(path, {"model": model, "optimizer": opt}, timeout=20, staging="background")
    train(model, opt, 1, start=1)  # waits at the gate until the start is agreed and its tensors copied
    handle.wait()
    fresh, fopt = build("ddp", seed=5)
    shardsafe.load(path, {"model": fresh, "optimizer": fopt}, timeout=20)
    assert_same(before, full_state(fresh, fopt))
    return True


def test_the_call_returns_before_the_other_ranks_arrive(tmp_path: Any) -> None:
    path, signal = str(tmp_path / "c"), str(tmp_path / "rank0-returned")
    assert check_ok(run_ranks(_returns_before_the_others_arrive, 2, path, signal, timeout=90)) == [True, True]


def test_a_refused_target_fails_at_wait_and_releases_the_optimizer(tmp_path: Any) -> None:
    """The target is checked when the save starts, on its thread: the refusal is ``wait()``'s, the
    optimizer's gate opens, and the committed checkpoint stays."""
    model, opt = build("plain")
    train(model, opt, 1)
    path = str(tmp_path / "c")
    shardsafe.save(path, {"model": model})
    handle = shardsafe.async_save(path, {"model": model, "optimizer": opt}, timeout=30, staging="background")
    train(model, opt, 1, start=1)  # the gate opens when the start fails
    with pytest.raises(shardsafe.CheckpointExistsError):
        handle.wait()
    assert handle.staged()
    shardsafe.verify(path)


def test_an_incremental_save_checks_chunks_it_refers_to(tmp_path: Any, monkeypatch: Any) -> None:
    """A tensor changed after the call to equal the base's bytes would be matched to the base and
    referred to, never copied: the version check covers it too (else the checkpoint would hold the
    base's value, not the value at the call)."""
    base, path = str(tmp_path / "base"), str(tmp_path / "next")
    w = torch.zeros(64)
    shardsafe.save(base, {"w": w, "v": torch.ones(4)})
    w.fill_(7.0)  # the value at the call: not the base's
    released = threading.Event()
    real = save_module.incremental.match

    def match_later(*args: Any, **kwargs: Any) -> Any:
        released.wait(20)
        return real(*args, **kwargs)

    monkeypatch.setattr(save_module.incremental, "match", match_later)
    handle = shardsafe.async_save(path, {"w": w, "v": torch.ones(4)}, base=base, staging="background")
    w.zero_()  # back to the base's bytes before the save compares them
    released.set()
    with pytest.raises(shardsafe.TornSnapshotError, match="'w'"):
        handle.wait()
    assert not os.path.exists(os.path.join(path, "MANIFEST.json"))


# ------------------------------------------------------------------ a change the library cannot see


def _unseen_change(rank: int, world: int, path: str) -> tuple[bool, str, bool]:
    model, opt = build("ddp")
    t = torch.arange(16.0)
    shardsafe.save(path, {"model": model, "t": t}, timeout=60)  # the previous checkpoint
    changed = threading.Event()
    staging.before_background_copy = lambda name: changed.wait(20) if name == "t" else None
    handle = shardsafe.async_save(
        path, {"model": model, "optimizer": opt, "t": t}, timeout=60, overwrite=True, staging="background"
    )
    t.add_(1)  # in place, before its copy, on every rank; no hook can see it
    changed.set()
    try:
        handle.wait()
    except shardsafe.CheckpointError as err:
        return isinstance(err, shardsafe.TornSnapshotError), str(err), handle.staged()
    return False, "committed", handle.staged()


def test_unseen_in_place_change_fails_the_save_on_every_rank(tmp_path: Any) -> None:
    path = str(tmp_path / "c")
    results = check_ok(run_ranks(_unseen_change, 2, path, timeout=90))
    for torn, message, staged in results:
        assert torn and staged, message
    assert any("tensor 't'" in m and "staging='blocking'" in m for _, m, _ in results), results
    assert torch.equal(shardsafe.load(path)["t"], torch.arange(16.0))  # the previous checkpoint, intact


# ------------------------------------------------------------------ failures of the background staging


def _stage_fails(rank: int, world: int, path: str) -> tuple[str, str]:
    model, opt = build("ddp")
    shardsafe.save(path, {"model": model}, timeout=60)
    train(model, opt, 1)
    handle = shardsafe.async_save(path, {"model": model}, timeout=60, overwrite=True, staging="background")
    try:
        handle.wait()
    except shardsafe.CheckpointError as err:
        return type(err).__name__, str(err)
    return "none", ""


def test_failed_background_staging_leaves_the_previous_checkpoint(tmp_path: Any) -> None:
    path = str(tmp_path / "c")
    out = run_ranks(_stage_fails, 2, path, timeout=90, rank_env={1: {"SHARDSAFE_FAULT": "save.stage:rank=1:raise"}})
    (k0, m0), (k1, m1) = check_ok(out)
    assert k0 == "RemoteRankError" and "rank 1" in m0, m0
    assert k1 == "UnforeseenError" and "phase 'stage'" in m1, m1
    model, _ = build("plain")  # the values of the first save (seed 0, untrained)
    loaded = shardsafe.load(path)["model"]
    for k, v in model.state_dict().items():
        assert torch.equal(loaded[k], v), k


def test_unwaited_failed_staging_raises_from_the_next_call_once(tmp_path: Any, monkeypatch: Any) -> None:
    model, _ = build("plain")
    path = str(tmp_path / "c")
    shardsafe.save(path, {"model": model})
    failures = [ValueError("disk on fire")]

    def fail_once(_name: str) -> None:
        if failures:
            raise failures.pop()

    monkeypatch.setattr(staging, "before_background_copy", fail_once)
    handle = shardsafe.async_save(path, {"model": model}, overwrite=True, staging="background")
    handle.wait_staged(timeout=30)
    assert handle.staged()
    with pytest.raises(shardsafe.CheckpointError, match="disk on fire"):
        shardsafe.save(str(tmp_path / "d"), {"model": model})  # the next call raises it...
    shardsafe.save(str(tmp_path / "d"), {"model": model})  # ...once
    shardsafe.verify(path)  # the previous checkpoint, intact


def test_unwaited_background_failure_surfaces_exactly_once(tmp_path: Any, monkeypatch: Any) -> None:
    """(any staging) The next call raises a failure nobody waited for; one already raised by wait() is
    not raised again. Fails on the drain that marked the error seen inside its own wait()."""
    real = save_module.write_file
    failures = [OSError("no space left")]

    def write_once(*args: Any, **kwargs: Any) -> Any:
        if failures:
            raise failures.pop()
        return real(*args, **kwargs)

    monkeypatch.setattr(save_module, "write_file", write_once)
    state = {"w": torch.ones(4)}
    handle = shardsafe.async_save(str(tmp_path / "a"), state)
    deadline = time.monotonic() + 30
    while not handle.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(shardsafe.CheckpointError, match="no space left"):
        shardsafe.save(str(tmp_path / "b"), state)
    shardsafe.save(str(tmp_path / "c"), state)
    failures.append(OSError("no space left"))
    handle = shardsafe.async_save(str(tmp_path / "d"), state)
    with pytest.raises(shardsafe.CheckpointError, match="no space left"):
        handle.wait()
    shardsafe.save(str(tmp_path / "e"), state)  # seen at wait(): not raised again


# ------------------------------------------------------------------ the options


def test_staging_option_is_checked_and_the_manager_passes_it(tmp_path: Any) -> None:
    with pytest.raises(shardsafe.InvalidArgumentError, match="staging="):
        shardsafe.async_save(str(tmp_path / "x"), {"w": torch.ones(2)}, staging="lazy")  # type: ignore[typeddict-item]
    with pytest.raises(shardsafe.InvalidArgumentError, match="staging="):
        shardsafe.CheckpointManager(str(tmp_path / "m"), async_save=True, staging="lazy")  # type: ignore[arg-type]
    w = torch.ones(2)
    with shardsafe.CheckpointManager(str(tmp_path / "m"), async_save=True, staging="background") as mgr:
        mgr.save(1, {"w": w})
        w.zero_()  # may tear the snapshot (then it fails) or not; never the new value
        try:
            mgr.wait()
        except shardsafe.TornSnapshotError:
            return
    assert torch.equal(shardsafe.load(str(tmp_path / "m" / "step-00000001"))["w"], torch.ones(2))


# ------------------------------------------------------------ what the call reads, encoded afterwards


class _Counter(nn.Module):
    """A module with extra state held in a dict it changes in place."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen = {"batches": 0, "names": ["a"]}

    def get_extra_state(self) -> Any:
        return self.seen

    def set_extra_state(self, state: Any) -> None:
        self.seen = state


def test_changes_after_the_call_to_what_it_read_do_not_reach_the_checkpoint(tmp_path: Any, monkeypatch: Any) -> None:
    """The call reads the module's and optimizer's state and encodes it on the save's thread: an
    optimizer's per-parameter entry replaced (not changed in place), its learning rate set, a
    module's extra state changed in place, a parameter replaced on the module, all right after the
    call, leave the checkpoint with the values at the call."""
    torch.manual_seed(0)
    model = _Counter()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model.lin(torch.randn(2, 4)).sum().backward()
    opt.step()
    before = {k: v.clone() for k, v in model.lin.state_dict().items()}
    p = model.lin.weight
    step_before = opt.state[p]["step"].clone()
    monkeypatch.setattr(staging, "before_background_copy", lambda _name: time.sleep(0.05))
    finish = flatten_module.Captured.finish
    encoded = threading.Event()

    def finish_later(self: Any, *args: Any) -> Any:  # the encoding comes after every change below
        assert encoded.wait(30)
        return finish(self, *args)

    monkeypatch.setattr(flatten_module.Captured, "finish", finish_later)
    path = str(tmp_path / "c")
    handle = shardsafe.async_save(path, {"model": model, "optimizer": opt}, staging="background")
    opt.state[p]["step"] = torch.tensor(99.0)  # a new tensor in place of the old one: no version counter sees it
    opt.state[p]["extra"] = 1.5
    opt.param_groups[0]["lr"] = 0.5
    model.seen["batches"] = 7
    model.seen["names"].append("b")
    model.lin.bias = nn.Parameter(torch.full((4,), 3.0))
    encoded.set()
    handle.wait()
    loaded = shardsafe.load(path)
    assert loaded["model"]["_extra_state"] == {"batches": 0, "names": ["a"]}
    for k, v in before.items():
        assert torch.equal(loaded["model"][f"lin.{k}"], v), k
    state = loaded["optimizer"]["state"]["lin.weight"]
    assert torch.equal(state["step"], step_before) and "extra" not in state
    assert loaded["optimizer"]["param_groups"][0]["lr"] == 0.01


def test_a_tensor_the_format_cannot_hold_is_refused_at_the_call(tmp_path: Any) -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.state[model.weight]["odd"] = torch.zeros(2, dtype=torch.complex32)
    with pytest.raises(shardsafe.UnsafeValueError, match="complex32"):
        shardsafe.async_save(str(tmp_path / "c"), {"model": model, "optimizer": opt}, staging="background")
    assert not os.path.exists(tmp_path / "c")


def test_a_background_save_writes_the_manifest_a_blocking_save_writes(tmp_path: Any) -> None:
    """Encoding after the call changes nothing in the checkpoint: the manifest's objects and tensors
    (names, order, shapes, dtypes, checksums) are those of a blocking save of the same state."""
    import json

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(8, 6)).sum().backward()
    opt.step()
    state = {"model": model, "optimizer": opt, "step": 3, "extra": {"w": torch.ones(2), "name": "x"}}
    manifests = []
    for mode in ("blocking", "background"):
        path = tmp_path / mode
        shardsafe.async_save(str(path), state, staging=mode).wait()
        manifests.append(json.loads((path / "MANIFEST.json").read_text()))
    blocking, background = manifests
    assert list(background["objects"]) == list(blocking["objects"])
    assert background["objects"] == blocking["objects"]

    def described(manifest: dict[str, Any]) -> list[Any]:
        return [
            (
                name,
                t["dtype"],
                t["shape"],
                [(c["offsets"], c["sizes"], c["digest"], c["checksums"]) for c in t["chunks"]],
            )
            for name, t in manifest["tensors"].items()
        ]

    assert described(background) == described(blocking)
    assert len(blocking["tensors"]) == 28  # the model's 9, 3 per parameter of the optimizer's 6, "extra/w"
