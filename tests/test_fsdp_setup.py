"""FSDP2 on CPU ranks, as a GPU machine runs them: the test models pin the CPU mesh, and
``Runtime(strategy="fsdp")`` shards a model without ever holding it whole on the device (meta tensors,
shard, ``to_empty`` for the local shards, fill from rank 0 one tensor at a time)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from harness import check_ok, run_ranks
from models import build, full_state, needs_fsdp2_on_cpu


class _Tied(nn.Module):
    """Tied embedding and head, a non-persistent buffer (not in the state dict) and blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.blocks = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 6)])
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("freq", torch.randn(6), persistent=False)


class _Allocations(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.device.type != "meta":
            self.largest = max(self.largest, out.untyped_storage().nbytes())
        return out


def _setup(rank: int, world: int) -> dict[str, Any]:
    from shardsafe.runtime.config import RuntimeConfig, resolve
    from shardsafe.runtime.strategies import setup_module

    torch.manual_seed(rank)  # every rank starts from other values: rank 0's must win
    model = _Tied()
    initial = {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    moved: list[str] = []
    real_to = nn.Module.to

    def spy(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        moved.append(str(torch._C._nn._parse_to(*args, **kwargs)[0]))
        return real_to(self, *args, **kwargs)

    plan = resolve(RuntimeConfig(accelerator="cpu", devices=world, strategy="fsdp"), None)
    nn.Module.to = spy  # type: ignore[method-assign]
    try:
        with _Allocations() as allocs:
            wrapped = setup_module(plan, torch.device("cpu"), model, [opt], None)
    finally:
        nn.Module.to = real_to  # type: ignore[method-assign]
    inner: Any = wrapped
    local = sum(p.to_local().numel() * p.element_size() for p in inner.parameters())
    full = {
        n: t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone() for n, t in inner.named_parameters()
    }
    full["freq"] = inner.freq.detach().clone()
    opt_params = [p for g in opt.param_groups for p in g["params"]]
    return {
        "initial": initial,
        "full": full,
        "moved": moved,
        "largest": allocs.largest,
        "local": local,
        "tied": inner.head.weight is inner.emb.weight,
        "rebound": all(any(p is q for q in inner.parameters()) for p in opt_params),
    }


@needs_fsdp2_on_cpu
def test_fsdp_setup_never_holds_the_whole_model_on_the_device() -> None:
    r0, r1 = check_ok(run_ranks(_setup, 2, timeout=120))
    total = sum(t.numel() * t.element_size() for n, t in r0["initial"].items() if n != "freq")
    biggest = max(t.numel() * t.element_size() for t in r0["initial"].values())
    for r in (r0, r1):
        assert r["moved"] == ["meta"], r["moved"]  # never model.to(device): the whole model on each device
        assert r["largest"] <= biggest  # one whole tensor at a time (the broadcast), else shards
        assert r["local"] < total * 0.75
        assert r["tied"] and r["rebound"]
        for name, want in r0["initial"].items():  # rank 0's values everywhere, non-persistent buffer too
            assert torch.equal(r["full"][name], want), name


def _build_with_an_accelerator_visible(rank: int, world: int) -> str:
    # What FSDP2 and DTensor see on a GPU machine: left to choose, they would pick CUDA for every rank
    torch._C._get_accelerator = lambda: torch.device("cuda")  # type: ignore[attr-defined]
    model, opt = build("fsdp")
    full_state(model, opt)
    return str(next(model.parameters()).device)


def test_cpu_ranks_stay_on_cpu_when_an_accelerator_is_visible() -> None:
    assert check_ok(run_ranks(_build_with_an_accelerator_visible, 2, timeout=120)) == ["cpu", "cpu"]
