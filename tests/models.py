"""Small models and helpers shared by the multi-process tests (importable by spawned ranks)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from shardsafe.runtime.compat import fsdp_on_cpu_problem

FSDP2_ON_CPU_PROBLEM = fsdp_on_cpu_problem()
needs_fsdp2_on_cpu = pytest.mark.skipif(
    FSDP2_ON_CPU_PROBLEM is not None,
    reason=f"{FSDP2_ON_CPU_PROBLEM}; tests/test_runtime_fsdp_cpu.py checks that shardsafe's runtime refuses it so",
)
"""For tests that run FSDP2 (``fully_shard``) on CPU ranks: skipped on a torch that cannot (2.6)."""


class Block(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * self.scale


class Net(nn.Module):
    """Odd sizes (7, 5, 3 rows) so that FSDP2 shards are uneven on 2, 3 and 4 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(6, 7), Block(7, 5)])
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def cpu_mesh() -> Any:
    """The world as a CPU mesh. Named explicitly: left to choose, FSDP2 and DTensor pick the
    accelerator when one is visible (every rank the same GPU, or one that does not exist)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def build(strategy: str, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model: nn.Module = Net()
    if strategy == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        mesh = cpu_mesh()
        for b in model.blocks:  # type: ignore[union-attr]
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif strategy in ("fsdp1", "fsdp1-flat"):  # FSDP1 with use_orig_params=True / False, one unit per block
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FullyShardedDataParallel(
            model,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            use_orig_params=strategy == "fsdp1",
            device_id=torch.device("cpu"),
        )
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, opt


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(8, 6, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _full(v: Any) -> Any:
    if hasattr(v, "full_tensor"):
        return v.full_tensor().clone()
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    return v


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Every parameter, buffer and optimizer state tensor, whole, keyed by name (uses collectives: test only)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(model, FullyShardedDataParallel):  # FSDP1: torch's own full state dicts
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
        out = {f"model/{k}": _full(v) for k, v in msd.items()}
        for name, st in osd["state"].items():
            for k, v in st.items():
                out[f"opt/{name}/{k}"] = _full(v)
        return out
    m = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    out = {f"model/{k}": _full(v) for k, v in m.state_dict().items()}
    names = {id(p): n for n, p in m.named_parameters()}
    flat = [p for g in opt.param_groups for p in g["params"]]
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            out[f"opt/{names[id(flat[i])]}/{k}"] = _full(v)
    return out


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k
