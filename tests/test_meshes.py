"""2-D device meshes, as torchtitan and Lightning's ModelParallelStrategy build them, on 4 CPU ranks:
HSDP (replicate x shard: ``fully_shard`` on a 2-D mesh) and FSDP x tensor parallel (``parallelize_module``
on the "tp" dimension, ``fully_shard`` on "dp"), saved once and loaded back bitwise on 4 ranks, resharded
to 2 ranks (other meshes) and into one plain process; FSDP1 hybrid sharding rides along. Replicated mesh
dimensions are written once, sharded ones by their owners (checked chunk by chunk in the manifest)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

import shardsafe

from harness import check_ok, run_ranks
from models import Block, Net, assert_same, full_state, needs_fsdp2_on_cpu, train


class MLP(nn.Module):
    """Tensor-parallel friendly: ``up`` column-wise, ``down`` row-wise (even over tp=2), ``head`` and the
    buffer only data-parallel (so on tp they are replicated); odd row counts shard unevenly over dp."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 10)
        self.down = nn.Linear(10, 5)
        self.head = nn.Linear(5, 3)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(torch.relu(self.up(x)))) * self.scale


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def build_2d(kind: str, world: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``hsdp``: Net, fully_shard on a (world/2 x 2) replicate x shard mesh; ``tp``: MLP, tensor
    parallel over tp=2 then fully_shard over dp=world/2; ``fsdp2``: Net or MLP (``fsdp2-mlp``) on a 1-D
    mesh; ``fsdp1-hybrid``: Net in FSDP1 HYBRID_SHARD over a (world/2 x 2) mesh."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model: nn.Module
    if kind == "hsdp":
        model = Net()
        mesh = _mesh((world // 2, 2), ("replicate", "shard"))
        for b in model.blocks:  # type: ignore[union-attr]
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif kind == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        model = MLP()
        mesh = _mesh((world // 2, 2), ("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    elif kind in ("fsdp2", "fsdp2-mlp"):
        model = Net() if kind == "fsdp2" else MLP()
        fully_shard(model, mesh=_mesh((world,), ("dp",)))
    elif kind == "fsdp1-hybrid":
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FullyShardedDataParallel(
            Net(),
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            sharding_strategy=ShardingStrategy.HYBRID_SHARD,
            device_mesh=_mesh((world // 2, 2), ("replicate", "shard")),
            use_orig_params=True,
            device_id=torch.device("cpu"),
        )
    else:
        raise ValueError(kind)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _train(model: nn.Module, opt: torch.optim.Optimizer, kind: str) -> None:
    if isinstance(model, Net) or kind in ("hsdp", "fsdp2", "fsdp1-hybrid"):
        train(model, opt, 2)
        return
    for step in range(2):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(500 + step))
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


KINDS = ["hsdp", "tp", "fsdp1-hybrid"]


def _save_all_then_reload(rank: int, world: int, root: str) -> dict[str, Any]:
    """On 4 ranks: for each kind, train, save, load into a fresh copy; return both full states."""
    out: dict[str, Any] = {}
    for kind in KINDS:
        model, opt = build_2d(kind, world, 0)
        _train(model, opt, kind)
        shardsafe.save(f"{root}/{kind}", {"model": model, "optim": opt, "step": 2}, timeout=60)
        model2, opt2 = build_2d(kind, world, 99)
        state: dict[str, Any] = {"model": model2, "optim": opt2, "step": 0}
        shardsafe.load(f"{root}/{kind}", state, timeout=60)
        out[kind] = (full_state(model, opt), full_state(model2, opt2), state["step"])
    return out


def _load_on_two(rank: int, world: int, root: str) -> dict[str, Any]:
    """On 2 ranks: every 4-rank checkpoint into other meshes."""
    out: dict[str, Any] = {}
    for saved, kind in [
        ("hsdp", "hsdp"),
        ("hsdp", "fsdp2"),
        ("tp", "tp"),
        ("tp", "fsdp2-mlp"),
        ("fsdp1-hybrid", "fsdp2"),
    ]:
        model, opt = build_2d(kind, world, 7)
        shardsafe.load(f"{root}/{saved}", {"model": model, "optim": opt}, timeout=60)
        out[f"{saved}->{kind}"] = full_state(model, opt)
    return out


def _no_duplicates(path: str) -> None:
    """Each tensor's chunks tile it exactly once: replicas wrote nothing."""
    from shardsafe.engine.read import read_manifest
    from shardsafe.storage import get_storage

    manifest = read_manifest(get_storage(path, None), path)
    for name, entry in manifest.tensors.items():
        assert sum(math.prod(c.sizes) for c in entry.chunks) == math.prod(entry.shape), name
        covered = torch.zeros(entry.shape, dtype=torch.int32)
        for c in entry.chunks:
            covered[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes, strict=True))] += 1
        assert bool((covered == 1).all()), name


@needs_fsdp2_on_cpu
def test_hsdp_and_fsdp_x_tp_round_trip_and_reshard(tmp_path: Any) -> None:
    root = str(tmp_path)
    results = check_ok(run_ranks(_save_all_then_reload, 4, root, timeout=240))
    saved = {}
    for kind in KINDS:
        original, reloaded, step = results[0][kind]
        assert step == 2
        assert_same(original, reloaded)
        saved[kind] = original
        _no_duplicates(f"{root}/{kind}")
        shardsafe.verify(f"{root}/{kind}")
        info = shardsafe.inspect(f"{root}/{kind}")
        assert info.world_size == 4 and len(info.files) >= 2, info.files
    two = check_ok(run_ranks(_load_on_two, 2, root, timeout=240))[0]
    for pair, loaded in two.items():
        assert_same(saved[pair.split("->")[0]], loaded)
    for kind in KINDS:  # and into one plain process
        model = Net() if kind != "tp" else MLP()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        shardsafe.load(f"{root}/{kind}", {"model": model, "optim": opt})
        assert_same(saved[kind], full_state(model, opt))
