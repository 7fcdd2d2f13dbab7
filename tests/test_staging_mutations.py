"""Mutation run of background staging: every way of changing the state after
``async_save(..., staging="background")`` returns gives the state at the call bit for bit, or
:class:`TornSnapshotError`; never another error, never a crash, never a checkpoint holding the change.

Each case builds a small state (a model with BatchNorm and its optimizer, plain tensors), saves it
with a blocking ``save`` (the copy at the call, to compare with), calls ``async_save(staging="background")``
with the copies held (``staging.before_background_copy``), changes the state one way, then lets the
copies go (2 ms apart, so that an optimizer step that follows runs while they are made). A case that
steps an optimizer lets them go first: the step waits for them. Outcomes:

- ``exact``: the save committed and loads equal, bit for bit, to the copy at the call;
- ``torn``: ``wait()`` raised :class:`TornSnapshotError`;
- ``mixed``: the save committed something else (what must never happen, except where docs/async.md
  lists the change as one background staging cannot see: that case expects it);
- ``crash: ...`` or ``error: ...``.

Each case states its outcome on this code. Cases whose change frees or replaces a tensor's memory
run in a child process (all of them in one, restarted after a crash), so that a segfault fails its case
and not the whole run. ``SHARDSAFE_MUTATION_ROUNDS=N`` (default 0) adds N rounds per case in which the
copies are not held but delayed at random, so the change lands before, during or after them: then
``exact`` and ``torn`` are both right for every case (a change after the copies is not in the save).
Run as a script (``python tests/test_staging_mutations.py``) it prints the table of outcomes.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardsafe
from shardsafe.engine import staging

ROUNDS = int(os.environ.get("SHARDSAFE_MUTATION_ROUNDS", "0"))
TESTS = Path(__file__).resolve().parent
SRC = Path(shardsafe.__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(240 + 30 * ROUNDS)


# ------------------------------------------------------------------------------------ the states


@dataclass
class Ctx:
    """One case's objects: the saved ``state`` and what the change needs."""

    model: nn.Module
    opt: torch.optim.Optimizer
    state: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)
    release: Callable[[], None] = lambda: None  # lets the copies go
    copying: threading.Event = field(default_factory=threading.Event)  # set as the first copy begins


def _net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def _batch(seed: int) -> torch.Tensor:
    return torch.randn(12, 8, generator=torch.Generator().manual_seed(seed))


def _backward(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    opt.zero_grad()
    model(_batch(seed)).pow(2).mean().backward()


def _train(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    _backward(model, opt, seed)
    opt.step()


def _opt(kind: str, params: Any) -> torch.optim.Optimizer:
    name, _, flavour = kind.partition("-")
    flags: dict[str, Any] = {"fused": True} if flavour == "fused" else {"foreach": flavour == "foreach"}
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, **flags)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=0.1, **flags)
    cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
    return cls(params, lr=0.01, **flags)


def _ctx(opt_kind: str = "adamw-foreach", where: str = "in", **extra: Any) -> Ctx:
    """A trained model and optimizer; ``where`` the optimizer is: ``in`` the state, ``out`` of it, or
    saved as ``opt.state_dict()`` (``sd``)."""
    torch.manual_seed(0)
    model = _net()
    opt = _opt(opt_kind, model.parameters())
    _train(model, opt, 1)
    state: dict[str, Any] = {"model": model}
    if where == "in":
        state["optimizer"] = opt
    elif where == "sd":
        state["optimizer"] = opt.state_dict()
    state["step"] = 7
    return Ctx(model, opt, state, dict(extra))


def _step(ctx: Ctx, opt: torch.optim.Optimizer | None = None, seed: int = 2) -> None:
    opt = opt or ctx.opt
    _backward(ctx.model, opt, seed)
    ctx.release()  # the step waits for the copies: let them go first (the first lands 2 ms later)
    opt.step()


def _with_tensor(**extra: Any) -> Ctx:
    ctx = _ctx(**extra)
    ctx.extra["t"] = ctx.state["t"] = torch.arange(64.0).reshape(8, 8)
    return ctx


# ------------------------------------------------------------------------------------ the cases


@dataclass(frozen=True)
class Case:
    name: str
    setup: Callable[[], Ctx]
    change: Callable[[Ctx], object]
    expect: str  # the outcome on this code ("exact", "torn", or "mixed" where documented as unseen)
    child: bool = False  # frees or replaces memory: run in a child process
    keep: str = ""  # the copies of tensors named so wait for the change to end, even once let go
    unseen: bool = False  # docs/async.md lists this change as one background staging cannot see


class _DataSGD(torch.optim.Optimizer):
    """A custom optimizer in the style of older code: it writes parameters through ``.data`` (no
    version counter moves)."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad.data, alpha=-group["lr"])


def _fused_on_thread(ctx: Ctx) -> None:
    done = threading.Thread(target=_step, args=(ctx,))
    done.start()
    done.join(60)


def _two_optimizers() -> Ctx:
    torch.manual_seed(0)
    model = _net()
    inside = torch.optim.AdamW(model[0].parameters(), lr=0.01)
    outside = torch.optim.Adam([*model[1].parameters(), *model[3].parameters()], lr=0.01, fused=True)
    _train(model, inside, 1)
    _train(model, outside, 1)
    return Ctx(model, inside, {"model": model, "optimizer": inside}, {"outside": outside})


def _two_optimizers_step(ctx: Ctx) -> None:
    _step(ctx, ctx.extra["outside"], 2)
    _step(ctx, ctx.opt, 3)


def _custom() -> Ctx:
    torch.manual_seed(0)
    model = _net()
    opt = _DataSGD(model.parameters(), lr=0.1)
    _train(model, opt, 1)
    return Ctx(model, opt, {"model": model})


def _scaler() -> Ctx:
    ctx = _ctx("adam-fused")
    ctx.extra["scaler"] = ctx.state["scaler"] = torch.amp.GradScaler("cpu")
    return ctx


def _scaler_step(ctx: Ctx) -> None:
    scaler = ctx.extra["scaler"]
    ctx.opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ctx.model(_batch(2)).float().pow(2).mean()
    scaler.scale(loss).backward()
    ctx.release()
    scaler.step(ctx.opt)
    scaler.update()


def _scheduler() -> Ctx:
    ctx = _ctx("adamw-foreach")
    ctx.extra["sched"] = ctx.state["sched"] = torch.optim.lr_scheduler.StepLR(ctx.opt, 1, gamma=0.5)
    return ctx


def _scheduler_step(ctx: Ctx) -> None:
    _step(ctx)
    ctx.extra["sched"].step()


def _tensor_lr() -> Ctx:
    torch.manual_seed(0)
    model = _net()
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01), fused=True)
    _train(model, opt, 1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    return Ctx(model, opt, {"model": model, "optimizer": opt, "sched": sched}, {"sched": sched})


def _in_plain_dict() -> Ctx:
    ctx = _ctx()
    ctx.state = {"model": ctx.model.state_dict(), "optimizer": ctx.opt}
    return ctx


def _ema() -> Ctx:
    ctx = _ctx()
    ema = _net()
    ema.load_state_dict(ctx.model.state_dict())
    ctx.extra["ema"] = ctx.state["ema"] = ema
    return ctx


def _ema_foreach(ctx: Ctx) -> None:
    _step(ctx)
    with torch.no_grad():
        torch._foreach_lerp_(list(ctx.extra["ema"].parameters()), list(ctx.model.parameters()), 0.1)


def _ema_data(ctx: Ctx) -> None:
    _step(ctx)
    for e, p in zip(ctx.extra["ema"].parameters(), ctx.model.parameters(), strict=True):
        e.data.mul_(0.9).add_(p.data, alpha=0.1)


def _other_thread(ctx: Ctx) -> None:
    worker = threading.Thread(target=lambda: ctx.extra["t"].add_(1))
    worker.start()
    worker.join(60)


def _forward(ctx: Ctx) -> None:
    ctx.model(_batch(5) * 3 + 1)  # train mode: BatchNorm's running statistics change


def _reallocate(ctx: Ctx) -> None:
    storage = ctx.extra["t"].untyped_storage()
    n = storage.nbytes()
    storage.resize_(0)
    storage.resize_(n)  # as FSDP-style code gathers into it again: new memory, other bytes


def _big() -> Ctx:
    ctx = _ctx()
    ctx.extra["t"] = torch.randn(16 << 20)  # 64 MiB: its own mapping, unmapped when freed
    ctx.state = {"t": ctx.extra["t"]}
    return ctx


def _free_under_the_copy(ctx: Ctx) -> None:
    ctx.release()
    ctx.copying.wait(30)
    time.sleep(0.005)  # its copy (tens of ms) has begun
    ctx.extra["t"].untyped_storage().resize_(0)


def _weight(ctx: Ctx) -> nn.Parameter:
    return ctx.model[0].weight  # type: ignore[return-value]


def _load_other_model(ctx: Ctx) -> None:
    torch.manual_seed(3)
    ctx.model.load_state_dict(_net().state_dict())


def _load_other_optimizer(ctx: Ctx) -> None:
    torch.manual_seed(4)
    model = _net()
    other = _opt("adamw-foreach", model.parameters())
    _train(model, other, 4)
    ctx.opt.load_state_dict(other.state_dict())


def _two_steps(ctx: Ctx) -> None:
    _step(ctx, seed=2)
    _step(ctx, seed=3)


CASES: list[Case] = [
    # optimizers, fused and not, in the state, outside it, saved as opt.state_dict()
    Case("fused Adam in the state, step", lambda: _ctx("adam-fused"), _step, "exact"),
    Case("fused AdamW outside the state, step", lambda: _ctx("adamw-fused", "out"), _step, "exact"),
    Case("fused SGD outside the state, step", lambda: _ctx("sgd-fused", "out"), _step, "exact"),
    Case("fused Adagrad outside the state, step", lambda: _ctx("adagrad-fused", "out"), _step, "exact"),
    Case("fused Adam saved as opt.state_dict(), step", lambda: _ctx("adam-fused", "sd"), _step, "exact"),
    Case("fused SGD saved as opt.state_dict(), step", lambda: _ctx("sgd-fused", "sd"), _step, "exact"),
    Case("foreach AdamW in the state, step", lambda: _ctx("adamw-foreach"), _step, "exact"),
    Case("foreach Adam outside the state, step", lambda: _ctx("adam-foreach", "out"), _step, "exact"),
    Case("for-loop SGD outside the state, step", lambda: _ctx("sgd-loop", "out"), _step, "exact"),
    Case("fused AdamW outside the state, two steps", lambda: _ctx("adamw-fused", "out"), _two_steps, "exact"),
    Case(
        "fused AdamW outside the state, step on another thread",
        lambda: _ctx("adamw-fused", "out"),
        _fused_on_thread,
        "exact",
    ),
    Case("two optimizers, the fused one outside the state", _two_optimizers, _two_optimizers_step, "exact"),
    Case("custom optimizer writing through .data, outside the state", _custom, _step, "exact"),
    Case("GradScaler stepping a fused Adam, scaler in the state", _scaler, _scaler_step, "exact"),
    Case("LR scheduler in the state, step then scheduler step", _scheduler, _scheduler_step, "exact"),
    Case("tensor learning rate, step then scheduler fills it", _tensor_lr, _scheduler_step, "exact"),
    Case("EMA model updated by _foreach_lerp_ after a step", _ema, _ema_foreach, "torn", keep="ema/"),
    Case("EMA model updated through .data after a step", _ema, _ema_data, "torn", keep="ema/"),
    # writes that move a version counter
    Case("plain tensor add_", _with_tensor, lambda c: c.extra["t"].add_(1), "torn"),
    Case("view of a plain tensor mul_", _with_tensor, lambda c: c.extra["t"][2:5].mul_(3), "torn"),
    Case("parameter written under no_grad", _ctx, lambda c: _no_grad(lambda: _weight(c).mul_(2)), "torn"),
    Case(
        "plain tensor written under inference_mode",
        _with_tensor,
        lambda c: _inference(lambda: c.extra["t"].add_(1)),
        "torn",
    ),
    Case("in-place add_ on another thread", _with_tensor, _other_thread, "torn"),
    Case("model.load_state_dict of another model", _ctx, _load_other_model, "torn"),
    # writes that move no version counter
    Case("parameter p.data.add_(1) before the step", _ctx, lambda c: _weight(c).data.add_(1), "torn"),
    Case("plain tensor t.data.mul_(2)", _with_tensor, lambda c: c.extra["t"].data.mul_(2), "torn"),
    Case(
        "plain tensor written through numpy",
        _with_tensor,
        lambda c: c.extra["t"].numpy().__setitem__((0, 0), 5.0),
        "torn",
    ),
    Case("BatchNorm forward, the module in the state", _ctx, _forward, "exact"),
    Case("BatchNorm forward, statistics in a plain state_dict() dict", _in_plain_dict, _forward, "torn"),
    Case(
        "plain tensor t.data[1:].add_(1): first bytes unchanged",
        _with_tensor,
        lambda c: c.extra["t"].data[1:].add_(1),
        "mixed",
        unseen=True,
    ),
    # memory freed or replaced
    Case(
        "plain tensor set_() to another tensor",
        _with_tensor,
        lambda c: c.extra["t"].set_(torch.zeros(3)),
        "torn",
        child=True,
    ),
    Case("plain tensor resize_(0)", _with_tensor, lambda c: c.extra["t"].resize_(0), "torn", child=True),
    Case(
        "storage freed: untyped_storage().resize_(0)",
        _with_tensor,
        lambda c: c.extra["t"].untyped_storage().resize_(0),
        "torn",
        child=True,
    ),
    Case(
        "parameter storage freed: untyped_storage().resize_(0)",
        _ctx,
        lambda c: _weight(c).untyped_storage().resize_(0),
        "torn",
        child=True,
    ),
    Case("storage freed and allocated again (FSDP-style)", _with_tensor, _reallocate, "torn", child=True),
    Case("storage of 64 MiB freed while its copy runs", _big, _free_under_the_copy, "torn", child=True),
    Case(
        "plain tensor .data = a smaller tensor",
        _with_tensor,
        lambda c: setattr(c.extra["t"], "data", torch.zeros(2)),
        "torn",
        child=True,
    ),
    Case(
        "plain tensor swapped (torch.utils.swap_tensors)",
        _with_tensor,
        lambda c: torch.utils.swap_tensors(c.extra["t"], torch.zeros(8, 8)),
        "torn",
        child=True,
    ),
    Case("parameter .data = another tensor", _ctx, lambda c: setattr(_weight(c), "data", torch.zeros(16, 8)), "exact"),
    # the state's containers changed
    Case(
        "parameter replaced on the module",
        _ctx,
        lambda c: setattr(c.model[0], "weight", nn.Parameter(torch.ones(16, 8))),
        "exact",
    ),
    Case("model.half()", _ctx, lambda c: c.model.half(), "exact"),
    Case("module buffer replaced", _ctx, lambda c: setattr(c.model[1], "running_mean", torch.ones(16)), "exact"),
    Case(
        "new optimizer state key", _ctx, lambda c: c.opt.state[_weight(c)].__setitem__("extra", torch.ones(2)), "exact"
    ),
    Case(
        "optimizer state entry replaced",
        _ctx,
        lambda c: c.opt.state[_weight(c)].__setitem__("exp_avg", torch.ones(16, 8)),
        "exact",
    ),
    Case("learning rate set in param_groups", _ctx, lambda c: c.opt.param_groups[0].__setitem__("lr", 0.5), "exact"),
    Case(
        "param group added", _ctx, lambda c: c.opt.add_param_group({"params": [nn.Parameter(torch.ones(3))]}), "exact"
    ),
    Case("optimizer.load_state_dict of another optimizer", _ctx, _load_other_optimizer, "exact"),
    Case("a plain value of the state replaced", _ctx, lambda c: c.state.__setitem__("step", 8), "exact"),
]


def _no_grad(fn: Callable[[], Any]) -> None:
    with torch.no_grad():
        fn()


def _inference(fn: Callable[[], Any]) -> None:
    with torch.inference_mode():
        fn()


# ------------------------------------------------------------------------------------ running one


def _same(a: Any, b: Any) -> bool:
    """Bit for bit (NaN included), recursively."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b) and type(a) is type(b)


def run_case(case: Case, where: Path, *, hold: bool = True, rng: random.Random | None = None) -> str:
    """One case's outcome (module docstring). ``hold``: the copies wait for the change; else (``rng``)
    they are delayed at random and the change comes after a random pause."""
    ctx = case.setup()
    ref, out = where / "at-the-call", where / "background"
    shardsafe.async_save(str(ref), ctx.state).wait()  # a copy at the call (a synchronous save would leave
    # the CPU tensors' storages not resizable: it writes them through numpy)
    released, changed = threading.Event(), threading.Event()
    delay = 0.002 if rng is None else rng.uniform(0, 0.004)

    def before_copy(name: str) -> None:
        if hold:
            released.wait(30)
            if case.keep and name.startswith(case.keep):
                changed.wait(30)
        ctx.copying.set()
        time.sleep(delay)

    staging.before_background_copy = before_copy
    try:
        handle = shardsafe.async_save(str(out), ctx.state, staging="background", timeout=60)
        ctx.release = released.set
        if rng is not None:
            time.sleep(rng.uniform(0, 0.01))
        try:
            case.change(ctx)
        except Exception as err:  # the case itself is wrong: reported, once the save is over
            broken: Exception | None = err
        else:
            broken = None
        changed.set()
        released.set()
        try:
            handle.wait()
        except shardsafe.TornSnapshotError:
            return "torn" if broken is None else f"error in the change: {broken!r}"
        except Exception as err:  # any other failure is a wrong outcome, reported by name
            return f"error: {type(err).__name__}: {err}"
        if broken is not None:
            return f"error in the change: {broken!r}"
    finally:
        changed.set()
        released.set()
        staging.before_background_copy = None
    return "exact" if _same(shardsafe.load(str(ref)), shardsafe.load(str(out))) else "mixed"


def _allowed(case: Case, held: bool) -> set[str]:
    if held:
        return {case.expect}
    return {"exact", "torn", "mixed"} if case.unseen or "another thread" in case.name else {"exact", "torn"}


# ------------------------------------------------------------------------------------ children


def _in_children(names: list[str], rounds: int, scratch: Path) -> dict[str, list[str]]:
    """Run the cases ``names`` in child processes (one at a time, started again after a crash): each
    case's outcomes, held first, then ``rounds`` at random."""
    out: dict[str, list[str]] = {}
    todo = list(names)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS)]), "OMP_NUM_THREADS": "1"}
    while todo:
        proc = subprocess.run(
            [sys.executable, str(Path(__file__)), "--child", str(rounds), *todo],
            env=env,
            cwd=scratch,
            capture_output=True,
            text=True,
            timeout=120 + 30 * len(todo) * (1 + rounds),
        )
        for line in proc.stdout.splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                out.setdefault(record["case"], []).append(record["outcome"])
        finished = [n for n in todo if len(out.get(n, [])) == 1 + rounds]
        if proc.returncode != 0:
            broken = next((n for n in todo if n not in finished), None)
            if broken is None:
                raise AssertionError(f"child exited {proc.returncode}:\n{proc.stderr[-4000:]}")
            out.setdefault(broken, []).append(f"crash: exit {proc.returncode}: {proc.stderr[-800:]}")
            out[broken] += ["crash: not run"] * (1 + rounds - len(out[broken]))
            finished.append(broken)
        todo = [n for n in todo if n not in finished]
    return out


def _child(rounds: int, names: list[str]) -> None:
    by_name = {c.name: c for c in CASES}
    rng = random.Random(7)
    for name in names:
        case = by_name[name]
        for r in range(1 + rounds):
            with tempfile.TemporaryDirectory() as tmp:
                outcome = run_case(case, Path(tmp), hold=r == 0, rng=None if r == 0 else rng)
            print(json.dumps({"case": name, "outcome": outcome}), flush=True)


# ------------------------------------------------------------------------------------ the tests


@pytest.fixture(scope="module")
def child_outcomes(tmp_path_factory: Any) -> dict[str, list[str]]:
    return _in_children([c.name for c in CASES if c.child], ROUNDS, tmp_path_factory.mktemp("children"))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_change_after_the_call(case: Case, tmp_path: Path, request: Any) -> None:
    if case.child:
        outcomes = request.getfixturevalue("child_outcomes")[case.name]
    else:
        rng = random.Random(11)
        outcomes = [run_case(case, tmp_path / "held")]
        for r in range(ROUNDS):
            outcomes.append(run_case(case, tmp_path / f"round{r}", hold=False, rng=rng))
    assert outcomes[0] in _allowed(case, True), (case.name, outcomes[0])
    wrong = [o for o in outcomes[1:] if o not in _allowed(case, False)]
    assert not wrong, (case.name, wrong)


def test_the_run_has_the_cases_it_claims() -> None:
    names = [c.name for c in CASES]
    assert len(names) == len(set(names)) >= 30
    assert {c.expect for c in CASES} == {"exact", "torn", "mixed"}
    assert all(c.unseen for c in CASES if c.expect == "mixed")  # each one listed in docs/async.md


def _table() -> None:
    """(script) Every case, its expected outcome and the outcomes seen, as a Markdown table."""
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        children = _in_children([c.name for c in CASES if c.child], ROUNDS, Path(tmp))
        rng = random.Random(11)
        for i, case in enumerate(CASES):
            if case.child:
                seen = children[case.name]
            else:
                seen = [run_case(case, Path(tmp) / f"{i}-held")]
                seen += [run_case(case, Path(tmp) / f"{i}-{r}", hold=False, rng=rng) for r in range(ROUNDS)]
            counts = {o: seen[1:].count(o) for o in sorted(set(seen[1:]))}
            ok = seen[0] in _allowed(case, True) and all(o in _allowed(case, False) for o in seen[1:])
            rows.append(f"| {case.name} | {case.expect} | {seen[0]} | {counts or ''} | {'ok' if ok else 'WRONG'} |")
    print("| change after the call | expected | held | random rounds | |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        _child(int(sys.argv[2]), sys.argv[3:])
    else:
        _table()
