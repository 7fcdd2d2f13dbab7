"""FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``), saved and loaded from each rank's own
flat-parameter shard, with no collective of the training process group.

An FSDP1 unit keeps its parameters in one flat, padded 1-D tensor, split in equal ranges over the
ranks; a rank's range cuts across parameters at arbitrary elements. torch's state-dict APIs for FSDP1
(``get_state_dict``/``set_state_dict`` and ``SHARDED_STATE_DICT``, ``FSDP.optim_state_dict``) all-gather
every unit's parameters and every optimizer state to re-chunk them per parameter, on save and on load.
Here each parameter's part of this rank's range is written as a few boxes of the parameter (a partial
first row, whole rows, a partial last row, recursively), which are views of the flat shard: no gather,
no copy. Loads read straight into the same views, in place, whatever layout was saved. Entries are
keyed by the model's own parameter names, so a checkpoint moves between FSDP1, FSDP2, DDP and a plain
model on any number of ranks, both ways.

Optimizer state follows its parameter: with ``use_orig_params=True`` each original parameter has its own
state (param-shaped tensors are 1-D, like the parameter's range); with ``use_orig_params=False`` the flat
parameter's state is split per original parameter (values such as ``step`` are repeated for each). With
``use_orig_params=True`` a rank holding none of a parameter has no state for it, so before planning the
ranks holding a parameter's first element publish its state's structure (keys, dtypes, small tensors
such as ``step``) through the rendezvous store (``gather``); then every rank describes the same state.

Loads plan these destinations like any other (state/restore.py fills a :class:`Layout` as it fills a
tensor: shapes checked before the go/no-go, verified reads); optimizer state: state/fsdp1_load.py.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardsafe.errors import InternalError, InvalidCallError, UnsafeValueError
from shardsafe.format.datafile import tensor_bytes
from shardsafe.format.values import decode, dtype_from_name, dtype_name, encode
from shardsafe.state.layout import Box, Layout

Gather = Callable[[str, str], list[str]]
"""(every rank) post a payload under a phase name, get every rank's payload in rank order"""

# Wrapper parts that never appear in state-dict keys (their wrappers strip them); ``_orig_mod`` of a
# compiled submodule does appear there, so it stays.
_WRAPPER_PARTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def clean_name(name: str) -> str:
    """A parameter or module name as state dicts spell it: without FSDP1 and activation-checkpoint wrappers."""
    if "_wrapped_module" not in name:  # no wrapper part: the name as it is (the common case)
        return name
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_PARTS)


def fsdp_class() -> Any:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    return FullyShardedDataParallel


def is_fsdp1(module: nn.Module) -> bool:
    cls = fsdp_class()
    return cls is not None and any(isinstance(m, cls) for m in module.modules())


def flat_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Boxes tiling the elements ``[lo, hi)`` of a row-major tensor of ``shape``, in order:
    (offsets, sizes, position of the box's first element relative to ``lo``). Each box is a
    contiguous run of elements, so its data is a slice of a 1-D tensor holding the range."""
    out: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
    if hi <= lo:
        return out
    if not shape:
        return [((), (), 0)]
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]

    def add(prefix: tuple[int, ...], dim: int, first: int, rows: int) -> None:
        offsets = (*prefix, first) + (0,) * (len(shape) - dim - 1)
        sizes = (1,) * len(prefix) + (rows, *shape[dim + 1 :])
        out.append((offsets, sizes, sum(o * s for o, s in zip(offsets, strides, strict=True)) - start))

    def split(prefix: tuple[int, ...], dim: int, a: int, b: int) -> None:
        inner = strides[dim]
        first, last = a // inner, b // inner  # row of a; rows before ``last`` end at or before b
        if a % inner:
            end = min(b, (first + 1) * inner)
            split((*prefix, first), dim + 1, a - first * inner, end - first * inner)
            if end == b:
                return
            first += 1
        if last > first:
            add(prefix, dim, first, last - first)
        if b % inner and b > max(first, last) * inner:
            split((*prefix, last), dim + 1, 0, b - last * inner)

    start = lo
    split((), 0, lo, hi)
    return out


@dataclass
class _Param:
    """An original parameter of an FSDP1 unit, as this rank holds it."""

    name: str  # relative to the FSDP1 root, wrappers removed
    aliases: list[str]  # other names of a shared parameter
    shape: tuple[int, ...]
    flat: nn.Parameter  # its FlatParameter
    lo: int  # this rank holds the elements [lo, hi) of the flattened parameter
    hi: int
    at: int  # where element ``lo`` sits in this rank's flat shard
    sharded: bool  # False: NO_SHARD, every rank holds the whole parameter
    owner: bool  # hybrid sharding: only the first replica group writes
    orig: nn.Parameter | None  # use_orig_params=True: the parameter the optimizer holds

    def layout(self, local: torch.Tensor, start: int) -> Layout:
        """The boxes of this parameter in ``local`` (a 1-D tensor) whose element ``start`` is element ``lo``."""
        if not self.sharded:  # NO_SHARD: the whole parameter, on every rank
            numel = math.prod(self.shape)
            whole = local[start : start + numel].view(self.shape)
            return Layout(self.shape, local.dtype, [((0,) * len(self.shape), whole)], True, True)
        boxes: list[Box] = []
        for offsets, sizes, pos in flat_boxes(self.shape, self.lo, self.hi):
            n = math.prod(sizes)
            boxes.append((offsets, local[start + pos : start + pos + n].view(sizes)))
        return Layout(self.shape, local.dtype, boxes, not self.sharded, self.owner)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def _params(root: nn.Module) -> list[_Param]:
    """(every rank, locally) The FSDP1-managed parameters under ``root``, from the flat parameters'
    own metadata. Refuses a unit that is not sharded right now (inside ``summon_full_params``/forward)."""
    import torch.distributed as dist

    cls = fsdp_class()
    modules = {id(m): clean_name(n) for n, m in root.named_modules()}
    out: list[_Param] = []
    for unit in cls.fsdp_modules(root):
        handle = getattr(unit, "_handle", None)
        if handle is None:
            continue
        flat = handle.flat_param
        for attr in ("_fqns", "_shapes", "_numels_with_padding", "_is_padding_mask"):
            if not hasattr(flat, attr):
                raise InternalError(
                    f"FSDP1 FlatParameter lacks {attr!r} in torch {torch.__version__}; shardsafe cannot find each "
                    "parameter's shard. Please report this with your torch version."
                )
        prefix = modules.get(id(handle._fully_sharded_module), "")
        sharded = bool(handle.uses_sharded_strategy)
        size = flat.numel()
        unsharded = sum(flat._numels_with_padding)
        expected = -(-unsharded // handle.world_size) if sharded else unsharded
        if size != expected:
            raise InvalidCallError(
                f"FSDP1 unit {prefix or '<root>'!r} holds {size} elements, not its shard of {expected} "
                f"({unsharded} over {handle.world_size} ranks): save and load outside forward/backward and "
                "outside summon_full_params()."
            )
        start = handle.rank * size if sharded else 0
        owner = True
        inter = getattr(unit, "_inter_node_pg", None)
        if sharded and inter is not None and "HYBRID" in str(getattr(unit, "sharding_strategy", "")):
            owner = dist.get_rank(inter) == 0
        pos, i = 0, 0
        by_name: dict[str, _Param] = {}
        for numel, pad in zip(flat._numels_with_padding, flat._is_padding_mask, strict=True):
            if not pad:
                lo, hi = max(pos, start) - pos, min(pos + numel, start + size) - pos
                if hi <= lo:
                    lo = hi = 0
                orig = flat._params[i] if getattr(flat, "_params", None) is not None else None
                name = _join(prefix, clean_name(flat._fqns[i]))
                q = _Param(name, [], tuple(flat._shapes[i]), flat, lo, hi, pos + lo - start, sharded, owner, orig)
                out.append(q)
                by_name[clean_name(flat._fqns[i])] = q
                i += 1
            pos += numel
        for info in getattr(flat, "_shared_param_infos", None) or []:
            primary = by_name.get(clean_name(_join(info.prim_module_name, info.prim_param_name)))
            if primary is not None:
                primary.aliases.append(_join(prefix, clean_name(_join(info.module_name, info.param_name))))
    return out


def _flat_param_ids(params: list[_Param]) -> set[int]:
    ids = {id(q.flat) for q in params}
    ids.update(id(q.orig) for q in params if q.orig is not None)
    return ids


def _other_tensors(root: nn.Module, params: list[_Param]) -> dict[str, torch.Tensor]:
    """Persistent buffers and parameters FSDP1 does not manage (ignored modules), by clean name."""
    managed = _flat_param_ids(params)
    out: dict[str, torch.Tensor] = {}
    for mname, m in root.named_modules():
        if type(m).get_extra_state is not nn.Module.get_extra_state:
            raise UnsafeValueError(
                f"module {clean_name(mname) or '<root>'!r} ({type(m).__name__}) has extra state; shardsafe does not "
                "save extra state of FSDP1 modules. Keep that state in a separate entry of the checkpoint."
            )
        for pname, p in m._parameters.items():
            if p is not None and id(p) not in managed:
                out[_join(clean_name(mname), pname)] = p
        for bname, b in m._buffers.items():
            if b is not None and bname not in m._non_persistent_buffers_set:
                out[_join(clean_name(mname), bname)] = b
    return out


def module_state(module: nn.Module) -> dict[str, Any] | None:
    """(every rank, locally, no collective; at save and at load) The state dict of a module holding
    FSDP1 units, by the model's own names: for each FSDP1-managed parameter a :class:`Layout`, the
    boxes of this rank's range of it (views of the flat shard, written from and read into in place);
    buffers and parameters FSDP1 does not manage as themselves. None when ``module`` holds no FSDP1 unit."""
    if not is_fsdp1(module):
        return None
    params = _params(module)
    value: dict[str, Any] = {}
    for q in params:
        layout = q.layout(q.flat.detach(), q.at)
        for name in (q.name, *q.aliases):
            value[name] = layout
    value.update(_other_tensors(module, params))
    return value


class Fsdp1State:
    """The FSDP1 modules of one state (``{key: module}``) and the optimizers over their parameters.
    Parameter names in optimizer state follow :func:`shardsafe.state.flatten.param_names`: the
    parameter's name with one module in the state, ``<key>.<name>`` with several."""

    def __init__(self, roots: Mapping[str, nn.Module], multi: bool) -> None:
        self.roots = dict(roots)
        self.params = {key: _params(root) for key, root in self.roots.items()}
        self.by_flat: dict[int, list[tuple[str, _Param]]] = {}
        self.by_orig: dict[int, tuple[str, _Param]] = {}
        for key, params in self.params.items():
            for q in params:
                oname = f"{key}.{q.name}" if multi else q.name
                self.by_flat.setdefault(id(q.flat), []).append((oname, q))
                if q.orig is not None:
                    self.by_orig[id(q.orig)] = (oname, q)
        self.skeletons: dict[str, dict[str, Any]] = {}  # optimizer param name -> state structure

    def touches(self, opt: torch.optim.Optimizer) -> bool:
        return any(self.manages(p) for g in opt.param_groups for p in g["params"])

    def manages(self, p: torch.Tensor) -> bool:
        """Whether ``p`` (a parameter an optimizer holds) is an FSDP1 flat or original parameter."""
        return id(p) in self.by_flat or id(p) in self.by_orig

    def names_of(self, p: torch.Tensor) -> list[str]:
        """The names optimizer state of ``p`` goes by: every original parameter of a flat parameter
        (``use_orig_params=False``), or the one original parameter (``True``)."""
        if id(p) in self.by_flat:
            return [oname for oname, _ in self.by_flat[id(p)]]
        return [self.by_orig[id(p)][0]]

    # ------------------------------------------------------------------------------------ save

    def exchange(self, optimizers: list[torch.optim.Optimizer], gather: Gather) -> None:
        """(every rank, once per save, before any optimizer_value) Publish the state structure of the
        ``use_orig_params=True`` parameters whose first element this rank holds; learn everyone's."""
        mine: dict[str, dict[str, Any]] = {}
        for opt in optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    found = self.by_orig.get(id(p))
                    st = opt.state.get(p)
                    if found is not None and st and found[1].lo == 0 and found[1].hi > 0 and found[1].owner:
                        mine[found[0]] = _describe(st, p, found[0])
        for payload in gather("fsdp1-optimizer-state", json.dumps(mine)):
            for name, desc in json.loads(payload).items():
                self.skeletons.setdefault(name, desc)

    def optimizer_value(self, opt: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, Any]:
        """(every rank, locally, after :meth:`exchange`) The optimizer's state keyed by parameter name,
        as :func:`shardsafe.state.flatten.optimizer_state` makes it, with a :class:`Layout` (this rank's
        boxes) for each state tensor shaped like its FSDP1 parameter."""
        state: dict[str, Any] = {}
        groups = []
        for g, group in enumerate(opt.param_groups):
            gnames: list[str] = []
            for i, p in enumerate(group["params"]):
                st = opt.state.get(p)
                if id(p) in self.by_flat:  # use_orig_params=False: split the flat state per parameter
                    for oname, q in self.by_flat[id(p)]:
                        gnames.append(oname)
                        if st:
                            state[oname] = {k: self._split(v, p, q, q.at) for k, v in st.items()}
                elif id(p) in self.by_orig:
                    oname, q = self.by_orig[id(p)]
                    gnames.append(oname)
                    if st:
                        state[oname] = {k: self._split(v, p, q, 0) for k, v in st.items()}
                    elif oname in self.skeletons:
                        state[oname] = self._synthesize(self.skeletons[oname], q, oname)
                else:
                    gnames.append(names.get(id(p), f"group{g}.{i}"))
                    if st:
                        state[gnames[-1]] = dict(st)
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": gnames})
        return {"state": state, "param_groups": groups}

    def _split(self, v: Any, p: torch.Tensor, q: _Param, start: int) -> Any:
        if isinstance(v, torch.Tensor) and v.dim() == 1 and v.shape == p.shape:
            return q.layout(v.detach(), start)
        return v

    def _synthesize(self, desc: dict[str, Any], q: _Param, where: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, d in desc.items():
            if d[0] == "shard":
                out[k] = Layout(q.shape, dtype_from_name(d[1], where), [], False, q.owner)
            elif d[0] == "tensor":
                raw = bytearray(base64.b64decode(d[3]))
                flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
                out[k] = flat.view(dtype_from_name(d[1], where)).reshape(d[2]).clone()
            else:
                out[k] = decode(d[1], where, _no_ref)
        return out


def _describe(st: Mapping[str, Any], p: torch.Tensor, where: str) -> dict[str, Any]:
    desc: dict[str, Any] = {}
    for k, v in st.items():
        if isinstance(v, torch.Tensor) and v.dim() == 1 and v.shape == p.shape:
            desc[k] = ["shard", dtype_name(v.dtype)]
        elif isinstance(v, torch.Tensor):
            if v.numel() > 4096:
                raise UnsafeValueError(
                    f"optimizer state {where}/{k}: a {tuple(v.shape)} tensor that is not shaped like its FSDP1 "
                    "parameter; only small per-parameter tensors (such as 'step') are supported with FSDP1"
                )
            raw = bytes(tensor_bytes(v.detach().cpu().resolve_conj().resolve_neg().contiguous()))
            desc[k] = ["tensor", dtype_name(v.dtype), list(v.shape), base64.b64encode(raw).decode()]
        else:
            desc[k] = ["value", encode(v, f"{where}/{k}", _no_tensor)]
    return desc


def _no_tensor(path: str, _t: torch.Tensor) -> str:
    raise UnsafeValueError(f"{path!r}: nested tensors in FSDP1 optimizer state are not supported")


def _no_ref(ref: str) -> Any:
    raise InternalError(f"unexpected tensor reference {ref!r} in an FSDP1 optimizer state description")
