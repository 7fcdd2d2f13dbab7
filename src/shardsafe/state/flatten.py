"""User state <-> what the format stores: one object per top-level key (module, optimizer, stateful,
value), each as typed JSON whose tensors are named items. Strategies are detected from the objects:
a DDP wrapper is unwrapped, FSDP2 parameters are sharded DTensors, anything else is a plain tensor,
assumed identical on every rank (the library writes it once).

Optimizer state is keyed by parameter name (found through the modules of the same state), so it
reshards and survives a change of wrapping.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardsafe.errors import UnsafeValueError
from shardsafe.format.manifest import SAFETENSORS_DTYPES
from shardsafe.format.values import PerRank, encode

try:
    from torch.distributed.tensor import DTensor, Partial, Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]


@dataclass
class TensorItem:
    """A tensor of the state as this rank holds it."""

    name: str
    local: torch.Tensor  # this rank's data (a DTensor's local shard)
    shape: tuple[int, ...]  # global shape
    offsets: tuple[int, ...]  # global offsets of ``local``
    replicated: bool  # every rank holds the same whole tensor
    owner: bool  # for sharded tensors: this rank writes its box (replicas on other mesh dims do not)
    dtensor: bool = False  # a DTensor (its placements say who holds what), not a plain tensor

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.local.dtype.itemsize


@dataclass
class FlatState:
    objects: dict[str, dict[str, Any]]  # key -> {"kind", "value" (typed JSON)}
    items: list[TensorItem]
    strategy: str
    per_rank: list[TensorItem] = field(default_factory=list)
    """Tensors of this rank's per-rank values (state/per_rank.py): written whole by this rank only."""
    per_rank_paths: list[list[Any]] = field(default_factory=list)
    """Where the ``per_rank`` nodes are: ``[key, step, ...]`` (dict keys, list/tuple indices), in the
    same order on every rank."""


def unwrap(module: nn.Module) -> nn.Module:
    """The module whose state dict keys are the model's names: no DDP ``module.``, ``torch.compile``
    ``_orig_mod.`` or Lightning Fabric ``_forward_module.`` prefix."""
    while True:
        if isinstance(module, nn.parallel.DistributedDataParallel):
            module = module.module
            continue
        inner = getattr(module, "_orig_mod", None)  # torch.compile
        if not isinstance(inner, nn.Module):
            inner = getattr(module, "_original_module", None)  # lightning.fabric's _FabricModule
        if not isinstance(inner, nn.Module) or inner is module:
            return module
        module = inner


def module_state(module: nn.Module) -> dict[str, Any]:
    """(every rank, locally) The state dict a module is saved from and loaded into: its own names, and
    tensors that share storage with its parameters and buffers (DTensor shards under FSDP2), so that
    filling them in place loads the module."""
    return unwrap(module).state_dict()


def load_module_state(module: nn.Module, sd: dict[str, Any]) -> None:
    """(every rank, after the reads) Hand a state dict filled from :func:`module_state` back to the
    module through its own load path (hooks, extra state)."""
    unwrap(module).load_state_dict(sd, strict=False)


def optimizer_current(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """(every rank, locally) The optimizer's state dict as torch keys it (parameter indices); its
    tensors are the optimizer's own, so they can be filled in place."""
    return opt.state_dict()


def load_optimizer_state(opt: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
    """(every rank, after the reads) Restore an optimizer from a state dict keyed as
    :func:`optimizer_current` keys it."""
    opt.load_state_dict(sd)


def is_sharded(t: torch.Tensor) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local_box(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...], bool, bool]:
    """(local data, global shape, global offsets, replicated, owner) of a tensor or DTensor."""
    if not is_sharded(t):
        return t.detach(), tuple(t.shape), (0,) * t.dim(), True, True
    assert DTensor is not None
    dt: Any = t
    if any(isinstance(p, Partial) for p in dt.placements):
        raise UnsafeValueError("a DTensor with Partial placement must be reduced before saving")
    shape = tuple(dt.shape)
    _, offsets = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    coord = dt.device_mesh.get_coordinate() or []
    replicate_dims = [i for i, p in enumerate(dt.placements) if isinstance(p, Replicate)]
    owner = all(coord[i] == 0 for i in replicate_dims) if coord else False
    replicated = len(replicate_dims) == len(dt.placements)
    return dt.to_local().detach(), shape, tuple(int(o) for o in offsets), replicated, owner


def param_names(state: Mapping[str, Any]) -> dict[int, str]:
    """id(parameter) -> stable name, from every module in ``state``. One module: its parameter names;
    several: ``<key>.<name>``."""
    modules = [(k, unwrap(v)) for k, v in state.items() if isinstance(v, nn.Module)]
    names: dict[int, str] = {}
    for key, module in modules:
        for name, p in module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), name if len(modules) == 1 else f"{key}.{name}")
    return names


def optimizer_names(opt: torch.optim.Optimizer, names: dict[int, str]) -> list[list[str]]:
    """Per parameter group, the names of its parameters (positional ``group<g>.<i>`` when unknown)."""
    out = []
    for g, group in enumerate(opt.param_groups):
        out.append([names.get(id(p), f"group{g}.{i}") for i, p in enumerate(group["params"])])
    return out


def optimizer_state(opt: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, Any]:
    """The optimizer's state dict with parameter indices replaced by parameter names."""
    sd = optimizer_current(opt)
    group_names = optimizer_names(opt, names)
    flat = [n for group in group_names for n in group]
    state = {flat[int(i)]: s for i, s in sd["state"].items()}
    groups = []
    for group, gnames in zip(sd["param_groups"], group_names, strict=True):
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": gnames})
    return {"state": state, "param_groups": groups}


def kind_of(obj: Any) -> str:
    """How an entry of the state is saved and loaded: ``module``, ``optimizer``, ``stateful`` (DCP's
    Stateful protocol: ``state_dict()`` and ``load_state_dict()``) or ``value``. A top-level
    ``per_rank(x)`` has the kind of ``x``."""
    if isinstance(obj, PerRank):
        obj = obj.value
    if isinstance(obj, nn.Module):
        return "module"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        return "stateful"
    return "value"


def flatten(state: Mapping[str, Any], *, allow_pickle: bool = False) -> FlatState:
    """(every rank, locally) Typed JSON per key plus the tensors, in a deterministic order."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a dict of str -> object, not {type(state).__name__}")
    names = param_names(state)
    items: list[TensorItem] = []
    taken: set[str] = set()
    strategies: set[str] = set()

    def on_tensor(path: str, t: torch.Tensor) -> str:
        name = path
        n = 1
        while name in taken:
            n += 1
            name = f"{path}#{n}"
        taken.add(name)
        if t.dtype not in SAFETENSORS_DTYPES:
            raise UnsafeValueError(f"{path!r}: tensors of dtype {t.dtype} cannot be stored in format v1")
        local, shape, offsets, replicated, owner = local_box(t)
        if not replicated:
            strategies.add("fsdp")
        items.append(TensorItem(name, local, shape, offsets, replicated, owner, dtensor=is_sharded(t)))
        return name

    objects: dict[str, dict[str, Any]] = {}
    for key, obj in state.items():
        if not isinstance(key, str) or not key or "/" in key:
            raise UnsafeValueError(f"state key {key!r}: top-level keys must be non-empty str without '/'")
        kind = kind_of(obj)
        if isinstance(obj, PerRank) and kind != "value":
            if kind != "stateful":
                raise UnsafeValueError(
                    f"{key!r}: per_rank() of a {kind}: its tensors are already placed by the strategy (sharded or "
                    "replicated); save it without per_rank()"
                )
            value: Any = PerRank(obj.value.state_dict())
        elif kind == "module":
            if isinstance(obj, nn.parallel.DistributedDataParallel):
                strategies.add("ddp")
            value = module_state(obj)
        elif kind == "optimizer":
            value = optimizer_state(obj, names)
        elif kind == "stateful":
            value = obj.state_dict()
        else:
            value = obj
        objects[key] = {"kind": kind, "value": encode(value, key, on_tensor, allow_pickle=allow_pickle)}
    strategy = "fsdp" if "fsdp" in strategies else ("ddp" if "ddp" in strategies else "plain")
    return FlatState(objects=objects, items=items, strategy=strategy)
