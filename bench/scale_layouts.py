"""Synthetic layouts for bench/scale_sim.py: Llama-style models (7B, 70B, 405B) with AdamW, under FSDP2
(one mesh of N ranks, ``Shard(0)``), HSDP (N/64 replicas of a 64-rank shard group: ``Replicate(),
Shard(0)``) and FSDP x TP (dp = N/8 by tp = 8, torchtitan's plan: column-wise weights, embeddings and
the output ``Shard(0)`` on tp and ``_StridedShard(0, 8)`` on dp; row-wise weights ``Shard(1)`` on tp and
``Shard(0)`` on dp; norms replicated on tp), float32.

What one simulated rank saves is built as shardsafe's ``flatten`` would hand it to the save: the
entries' typed JSON comes from a real ``flatten`` of the same model structure with tiny tensors (real
parameter names, real optimizer entries); the tensors are meta tensors of this rank's boxes, which
torch's own placement code gives (``_compute_local_shape_and_global_offset`` for ``Shard`` and
``Replicate``, each placement's ``_split_tensor`` on an index for ``_StridedShard``, as
``state/layout.py`` does for a live DTensor), with the rule ``state/layout.py`` derives from the
mesh and placements. No training, no data: the metadata is what is measured.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from shardsafe.state.flatten import FlatState, TensorItem, flatten
from shardsafe.state.layout import Rule, _rule


@dataclass(frozen=True)
class Llama:
    name: str
    layers: int
    dim: int
    hidden: int
    vocab: int
    kv_heads: int
    heads: int

    def params(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(name, shape, tensor-parallel style) of every parameter, in module order."""
        kv = self.dim // self.heads * self.kv_heads
        out: list[tuple[str, tuple[int, ...], str]] = [("tok_embeddings.weight", (self.vocab, self.dim), "col")]
        for i in range(self.layers):
            p = f"layers.{i}."
            out += [
                (p + "attention.wq.weight", (self.dim, self.dim), "col"),
                (p + "attention.wk.weight", (kv, self.dim), "col"),
                (p + "attention.wv.weight", (kv, self.dim), "col"),
                (p + "attention.wo.weight", (self.dim, self.dim), "row"),
                (p + "feed_forward.w1.weight", (self.hidden, self.dim), "col"),
                (p + "feed_forward.w2.weight", (self.dim, self.hidden), "row"),
                (p + "feed_forward.w3.weight", (self.hidden, self.dim), "col"),
                (p + "attention_norm.weight", (self.dim,), "norm"),
                (p + "ffn_norm.weight", (self.dim,), "norm"),
            ]
        out += [("norm.weight", (self.dim,), "norm"), ("output.weight", (self.vocab, self.dim), "col")]
        return out


MODELS = {
    "7B": Llama("7B", 32, 4096, 11008, 32000, 32, 32),
    "70B": Llama("70B", 80, 8192, 28672, 128256, 8, 64),
    "405B": Llama("405B", 126, 16384, 53248, 128256, 8, 128),
}
STRATEGIES = ("fsdp2", "hsdp", "fsdp_tp")
HSDP_SHARD = 64
TP = 8


class SimMesh:
    """What ``state/layout.py`` reads of a DeviceMesh for a rule (its rank grid), hashable like one."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape
        self.mesh = torch.arange(math.prod(shape)).reshape(shape)

    def __hash__(self) -> int:
        return hash(self.shape)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SimMesh) and other.shape == self.shape


def mesh_shape(strategy: str, world: int) -> tuple[int, ...]:
    if strategy == "fsdp2":
        return (world,)
    if strategy == "hsdp":
        return (world // min(world, HSDP_SHARD), min(world, HSDP_SHARD))
    return (world // TP, TP)


def placements(strategy: str, style: str) -> list[Any]:
    if strategy == "fsdp2":
        return [Shard(0)]
    if strategy == "hsdp":
        return [Replicate(), Shard(0)]
    if style == "col":
        return [_StridedShard(0, split_factor=TP), Shard(0)]
    if style == "row":
        return [Shard(0), Shard(1)]
    return [Shard(0), Replicate()]


def coordinate(shape: tuple[int, ...], rank: int) -> tuple[int, ...]:
    out = []
    for n in reversed(shape):
        rank, c = divmod(rank, n)
        out.append(c)
    return tuple(reversed(out))


@functools.lru_cache(maxsize=1 << 16)
def torch_boxes(
    shape: tuple[int, ...], mesh: tuple[int, ...], where: tuple[Any, ...], coord: tuple[int, ...]
) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    """The boxes (offsets, sizes) a DTensor of ``shape`` placed ``where`` on a mesh of shape ``mesh`` holds at
    ``coord``, by torch's own placement code (module docstring); empty ones left out."""
    kinds = [type(p).__name__ for p in where]
    if "_StridedShard" not in kinds:
        size, offset = _compute_local_shape_and_global_offset(shape, mesh, list(coord), list(where))
        return ((tuple(offset), tuple(size)),) if math.prod(size) else ()
    index = [torch.arange(n) for n in shape]
    for i, p in enumerate(where):
        if p.is_replicate():
            continue
        along = _StridedShard(0, split_factor=p.split_factor) if isinstance(p, _StridedShard) else Shard(0)
        parts, _ = along._split_tensor(index[p.dim], mesh[i], with_padding=False)
        index[p.dim] = parts[coord[i]] if coord[i] < len(parts) else index[p.dim][:0]
    runs = []
    for idx in index:
        out: list[list[int]] = []
        for g in idx.tolist():
            if out and out[-1][0] + out[-1][1] == g:
                out[-1][1] += 1
            else:
                out.append([g, 1])
        if not out:
            return ()
        runs.append(out)
    import itertools

    return tuple((tuple(r[0] for r in c), tuple(r[1] for r in c)) for c in itertools.product(*runs))


@functools.lru_cache(maxsize=4096)
def rule_of(strategy: str, world: int, style: str, ndim: int) -> Rule | None:
    """The rule ``state/layout.py`` derives for this mesh and these placements (its own code)."""
    return _rule(SimMesh(mesh_shape(strategy, world)), tuple(placements(strategy, style)), ndim)


@functools.lru_cache(maxsize=64)
def _meta(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.float32, device="meta")


class Layout:
    """One model under one strategy on ``world`` ranks: the typed JSON of its entries (from a real
    ``flatten`` of the structure with tiny tensors) and, per rank, the tensors it holds."""

    def __init__(self, model: Llama, strategy: str, world: int) -> None:
        self.model, self.strategy, self.world = model, strategy, world
        self.mesh = mesh_shape(strategy, world)
        self.spec = {f"model/{n}": (s, st) for n, s, st in model.params()}
        for n, s, st in model.params():
            for k in ("exp_avg", "exp_avg_sq"):
                self.spec[f"optim/state/{n}/{k}"] = (s, st)
        self.objects, self.names = _structure(model)

    @property
    def tensors(self) -> int:
        return len(self.names)

    def flat(self, rank: int) -> FlatState:
        """What rank ``rank``'s ``flatten`` hands the save (module docstring)."""
        coord = coordinate(self.mesh, rank)
        items = []
        for name in self.names:
            spec = self.spec.get(name)
            if spec is None:  # an optimizer step: a plain 0-d tensor, the same on every rank
                items.append(TensorItem(name, _meta(()), (), (), True, True))
                continue
            shape, style = spec
            where = placements(self.strategy, style)
            owner = all(c == 0 for c, p in zip(coord, where, strict=True) if p.is_replicate())
            boxes = torch_boxes(shape, self.mesh, tuple(where), coord)
            pieces = [(o, _meta(s)) for o, s in boxes]
            first = pieces[0] if pieces else ((0,) * len(shape), _meta((0,) * len(shape)))
            items.append(
                TensorItem(
                    name,
                    first[1],
                    shape,
                    first[0],
                    False,
                    owner,
                    True,
                    pieces if len(pieces) != 1 else None,
                    rule_of(self.strategy, self.world, style, len(shape)),
                )
            )
        return FlatState(objects=self.objects, items=items, strategy="fsdp")

    def local_bytes(self, rank: int) -> int:
        coord = coordinate(self.mesh, rank)
        total = 0
        for name in self.names:
            spec = self.spec.get(name)
            if spec is None:
                continue
            for _, s in torch_boxes(spec[0], self.mesh, tuple(placements(self.strategy, spec[1])), coord):
                total += math.prod(s) * 4
        return total


class _Tiny(nn.Module):
    """The model's module tree with 1-element parameters: real names for a real ``flatten``."""

    def __init__(self, model: Llama) -> None:
        super().__init__()
        for name, _, _ in model.params():
            parent: nn.Module = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(parent, part):
                    parent.add_module(part, nn.Module())
                parent = getattr(parent, part)
            parent.register_parameter(leaf, nn.Parameter(torch.zeros(1)))


@functools.lru_cache(maxsize=8)
def _structure(model: Llama) -> tuple[dict[str, Any], list[str]]:
    tiny = _Tiny(model)
    opt = torch.optim.AdamW(tiny.parameters(), lr=3e-4)
    for p in tiny.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    flat = flatten({"model": tiny, "optim": opt})
    return flat.objects, [i.name for i in flat.items]


@functools.lru_cache(maxsize=1 << 16)
def local_shape(
    shape: tuple[int, ...], mesh: tuple[int, ...], where: tuple[Any, ...], coord: tuple[int, ...]
) -> tuple[int, ...]:
    """The shape of the local tensor a DTensor of ``shape`` placed ``where`` holds at ``coord``: the
    indices each dimension keeps after every placement's split (torch's code, as in :func:`torch_boxes`)."""
    lengths = list(shape)
    runs = torch_boxes(shape, mesh, where, coord)
    if not runs:
        size, _ = _compute_local_shape_and_global_offset(shape, mesh, list(coord), list(where))
        return tuple(int(s) for s in size)
    for d in range(len(shape)):
        lengths[d] = sum(n for _, n in {(b[0][d], b[1][d]) for b in runs})
    return tuple(lengths)


def dtensor_state(layout: Layout, rank: int) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    """(a process with a fake process group of ``layout.world`` ranks at ``rank``) The model and AdamW of
    ``layout`` as rank ``rank`` holds them: DTensor parameters and moments over uninitialised CPU memory
    (never touched: no resident pages), float32 steps; and the same as DCP's flat state dict."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    names = {"fsdp2": ("dp",), "hsdp": ("replicate", "shard"), "fsdp_tp": ("dp", "tp")}[layout.strategy]
    mesh = init_device_mesh("cpu", layout.mesh, mesh_dim_names=names)
    coord = coordinate(layout.mesh, rank)

    def make(shape: tuple[int, ...], style: str) -> Any:
        where = tuple(placements(layout.strategy, style))
        local = torch.empty(local_shape(shape, layout.mesh, where, coord))
        stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
        return DTensor.from_local(local, mesh, list(where), run_check=False, shape=shape, stride=stride)

    model = _Tiny(layout.model)
    for name, shape, style in layout.model.params():
        *path, leaf = name.split(".")
        parent: nn.Module = model
        for part in path:
            parent = getattr(parent, part)
        setattr(parent, leaf, nn.Parameter(make(shape, style)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    dcp: dict[str, Any] = {}
    for (name, shape, style), p in zip(layout.model.params(), model.parameters(), strict=True):
        state = {"step": torch.tensor(1.0), "exp_avg": make(shape, style), "exp_avg_sq": make(shape, style)}
        opt.state[p] = state
        dcp[f"model.{name}"] = p
        for k, v in state.items():
            dcp[f"optim.state.{name}.{k}"] = v
    return model, opt, dcp
