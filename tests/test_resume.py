"""Exact resume: train N, save, train M; versus load and train M: bitwise-equal parameters and
optimizer state, with model + optimizer + LR scheduler + RNG state + a step counter."""

from __future__ import annotations

from typing import Any

import torch

import shardsafe

from harness import check_ok, run_ranks
from models import assert_same, build, full_state, needs_fsdp2_on_cpu


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, n: int) -> None:
    for _ in range(n):
        x = torch.randn(8, 6)  # global RNG: resuming must restore it
        loss = torch.nn.functional.dropout(model(x), p=0.3).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def _setup(strategy: str, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    model, opt = build(strategy, seed=seed)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, step: int) -> dict[str, Any]:
    return {"model": model, "optimizer": opt, "scheduler": sched, "rng": torch.get_rng_state(), "step": step}


def _uninterrupted(rank: int, world: int, path: str, strategy: str) -> dict[str, Any]:
    model, opt, sched = _setup(strategy, 0)
    torch.manual_seed(42)
    _steps(model, opt, sched, 3)
    shardsafe.save(path, _state(model, opt, sched, 3), timeout=60)
    _steps(model, opt, sched, 3)
    return {**full_state(model, opt), "lr": opt.param_groups[0]["lr"]}


def _resumed(rank: int, world: int, path: str, strategy: str) -> dict[str, Any]:
    model, opt, sched = _setup(strategy, 99)
    torch.manual_seed(7)  # a different RNG stream, to be replaced by the saved one
    state = _state(model, opt, sched, 0)
    shardsafe.load(path, state, timeout=60)
    torch.set_rng_state(state["rng"])
    assert state["step"] == 3
    _steps(model, opt, sched, 3)
    return {**full_state(model, opt), "lr": opt.param_groups[0]["lr"]}


def test_exact_resume_single_process(tmp_path: Any) -> None:
    path = str(tmp_path / "c")
    a = _uninterrupted(0, 1, path, "plain")
    b = _resumed(0, 1, path, "plain")
    assert_same(a, b)


@needs_fsdp2_on_cpu
def test_exact_resume_fsdp_two_ranks(tmp_path: Any) -> None:
    path = str(tmp_path / "c")
    a = check_ok(run_ranks(_uninterrupted, 2, path, "fsdp", timeout=120))
    b = check_ok(run_ranks(_resumed, 2, path, "fsdp", timeout=120))
    assert_same(a[0], b[0])
    assert_same(a[1], b[1])
