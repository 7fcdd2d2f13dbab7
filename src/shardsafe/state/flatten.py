"""User state <-> what the format stores: one object per top-level key (module, optimizer, stateful,
value), each as typed JSON whose tensors are named items. Strategies are detected from the objects:
a DDP wrapper is unwrapped, FSDP2 parameters are sharded DTensors (any mesh: see state/layout.py),
FSDP1 modules are read from their flat shards (state/fsdp1.py), anything else is a plain tensor,
assumed identical on every rank (the library writes it once).

Optimizer state is keyed by parameter name (found through the modules of the same state), so it
reshards and survives a change of wrapping.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardsafe.errors import InvalidTypeError, UnsafeValueError
from shardsafe.format.manifest import SAFETENSORS_DTYPES
from shardsafe.format.values import MAX_DEPTH, PerRank, encode
from shardsafe.state import fsdp1
from shardsafe.state.layout import Box, Layout, Rule, is_sharded_tensor, layout_of
from shardsafe.state.rng import RNGState

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]


_PLAIN = (torch.Tensor, nn.Parameter)
"""Tensor types held whole by every rank (what :func:`~shardsafe.state.layout.layout_of` says of them)."""


@dataclass(slots=True)
class TensorItem:
    """A tensor of the state as this rank holds it."""

    name: str
    local: torch.Tensor  # this rank's data (a DTensor's local shard); for several boxes, the first (or empty)
    shape: tuple[int, ...]  # global shape
    offsets: tuple[int, ...]  # global offsets of ``local``
    replicated: bool  # every rank holds the same whole tensor
    owner: bool  # for sharded tensors: this rank writes its box (replicas on other mesh dims do not)
    dtensor: bool = False  # placed by a strategy (DTensor, ShardedTensor, FSDP1 shard), not a plain tensor
    pieces: list[Box] | None = None  # this rank's boxes when it holds other than one (FSDP1, strided DTensors)
    rule: Rule | None = None  # its sharding as a rule (format v3), the same on every rank

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.local.dtype.itemsize

    def boxes(self) -> list[Box]:
        """(global offsets, data) of every box this rank holds."""
        return self.pieces if self.pieces is not None else [(self.offsets, self.local)]


@dataclass(frozen=True)
class Filtered:
    """A state entry saved with only the items of its state dict that ``keep(name, value)`` accepts
    (Lightning Fabric's ``filter=``). A module stays a module entry (with fewer tensors); an optimizer
    becomes a plain value; an entry left empty is not saved at all."""

    obj: Any
    keep: Callable[[str, Any], bool]


@dataclass
class FlatState:
    objects: dict[str, dict[str, Any]]  # key -> {"kind", "value" (typed JSON)}
    items: list[TensorItem]
    strategy: str
    per_rank: list[TensorItem] = field(default_factory=list)
    """Tensors of this rank's per-rank values (state/per_rank.py): written whole by this rank only."""
    buffers: list[torch.Tensor] = field(default_factory=list)
    """The buffers of the state's modules (BatchNorm statistics, which a forward changes in place)."""
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


def module_state(module: nn.Module, *, holds_fsdp1: bool | None = None) -> dict[str, Any]:
    """(every rank, locally) The state dict a module is saved from and loaded into: its own names, and
    tensors that share storage with its parameters and buffers (DTensor shards under FSDP2), so that
    filling them in place loads the module. A module holding FSDP1 units gives a :class:`Layout` per
    FSDP1-managed parameter instead: the boxes of this rank's range of it, views of its flat shard
    (state/fsdp1.py; FSDP1's own ``state_dict()`` would gather). ``holds_fsdp1``: whether it holds FSDP1
    units, where the caller has looked already (else it is looked for here)."""
    inner = unwrap(module)
    if holds_fsdp1 is None:
        holds_fsdp1 = fsdp1.is_fsdp1(inner)
    sharded = fsdp1.module_state(inner) if holds_fsdp1 else None
    return inner.state_dict() if sharded is None else sharded


def load_module_state(module: nn.Module, sd: dict[str, Any]) -> None:
    """(every rank, after the reads) Hand a state dict filled from :func:`module_state` back to the
    module through its own load path (hooks, extra state). FSDP1: nothing to hand back, every
    destination was the module's own storage (its ``load_state_dict`` would gather)."""
    inner = unwrap(module)
    if not fsdp1.is_fsdp1(inner):
        inner.load_state_dict(sd, strict=False)


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


def modules_of(state: Mapping[str, Any]) -> list[tuple[str, nn.Module]]:
    """The modules of ``state`` by key, unwrapped (also inside :class:`Filtered`)."""
    out = []
    for k, v in state.items():
        v = v.obj if isinstance(v, Filtered) else v
        if isinstance(v, nn.Module):
            out.append((k, unwrap(v)))
    return out


@dataclass
class ModuleWalk:
    """What one walk over the submodules of every module in a state finds (:func:`walk_modules`)."""

    names: dict[int, str]
    """id(parameter) -> stable name (:func:`param_names`)."""
    fsdp1_keys: set[str]
    """The keys of the state's modules that hold FSDP1 units."""
    buffers: list[torch.Tensor]
    """Every buffer of those modules (persistent or not), as the modules hold them."""


def walk_modules(state: Mapping[str, Any]) -> ModuleWalk:
    """(every rank, locally) One walk over every submodule of every module in ``state`` (a save's
    call walks the state's modules once here instead of once per question: the walk is a large part
    of the call's cost for models of many small layers)."""
    modules = modules_of(state)
    fsdp_class = fsdp1.fsdp_class()
    found = ModuleWalk({}, set(), [])
    names, buffers = found.names, found.buffers
    for key, module in modules:
        prefix_key = f"{key}." if len(modules) > 1 else ""
        for prefix, sub in module.named_modules(remove_duplicate=False):  # as named_parameters walks
            if fsdp_class is not None and isinstance(sub, fsdp_class):
                found.fsdp1_keys.add(key)
            for pname, p in sub._parameters.items():
                if p is not None and id(p) not in names:
                    names[id(p)] = prefix_key + fsdp1.clean_name(f"{prefix}.{pname}" if prefix else pname)
            for b in sub._buffers.values():
                if b is not None:
                    buffers.append(b)
    return found


def param_names(state: Mapping[str, Any]) -> dict[int, str]:
    """id(parameter) -> stable name, from every module in ``state``. One module: its parameter names;
    several: ``<key>.<name>``. FSDP1 and activation-checkpoint wrapper parts are left out of names."""
    return walk_modules(state).names


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


def flatten(
    state: Mapping[str, Any],
    *,
    allow_pickle: bool = False,
    gather: fsdp1.Gather | None = None,
) -> FlatState:
    """(every rank) Typed JSON per key plus the tensors, in a deterministic order. Local, except for
    FSDP1 optimizers with ``use_orig_params=True``: their state structure is exchanged through
    ``gather`` (every rank's payload, through the rendezvous store; state/fsdp1.py), which waits for
    every rank. Without ``gather``, one process is assumed."""
    return capture(state, allow_pickle=allow_pickle, gather=gather, defer=False).finish()


def capture(
    state: Mapping[str, Any],
    *,
    allow_pickle: bool = False,
    gather: fsdp1.Gather | None = None,
    defer: bool = True,
) -> Captured:
    """(every rank) :func:`flatten` in two steps. This one reads the state: every entry's value is
    taken from its object (a module's state dict, an optimizer's state by parameter name), and encoded
    now, or, with ``defer``, kept as a frozen copy for :meth:`Captured.finish` to encode where that is
    safe (:func:`_frozen`: a module or optimizer entry whose containers this copy owns and whose leaves
    are plain tensors or immutable values), so that ``async_save(staging="background")`` returns after
    reading the state, before encoding it. The frozen copy's tensors are the caller's (its
    :attr:`Captured.leaves`): their contents may still change, which background staging detects
    through their version counters."""
    if not isinstance(state, Mapping):
        raise InvalidTypeError(f"state must be a dict of str -> object, not {type(state).__name__}")
    walk = walk_modules(state)
    names = walk.names
    fsdp = _fsdp1_state(state, gather, walk.fsdp1_keys)  # FSDP1 hook: None unless the state holds an FSDP1 module
    sink = _Sink()
    out = Captured(sink, allow_pickle, walk.buffers)
    for key, entry in state.items():
        if not isinstance(key, str) or not key or "/" in key:
            raise UnsafeValueError(f"state key {key!r}: top-level keys must be non-empty str without '/'")
        obj, keep = (entry.obj, entry.keep) if isinstance(entry, Filtered) else (entry, None)
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
                sink.strategies.add("ddp")
            value = _stand_ins(module_state(obj, holds_fsdp1=fsdp is not None and key in fsdp.roots), sink.shards)
        elif kind == "optimizer":
            if fsdp is not None and fsdp.touches(obj):
                value = _stand_ins(fsdp.optimizer_value(obj, names), sink.shards)
            else:
                value = optimizer_state(obj, names)
        elif kind == "stateful":
            value = obj.state_dict()
            if isinstance(obj, RNGState):  # this rank's own generators, whatever they hold
                value = PerRank(value)
        else:
            value = obj
        if kind in ("value", "stateful"):
            value = nested_states(value, key, allow_pickle)
        if keep is not None and isinstance(value, Mapping):
            value = {k: v for k, v in value.items() if keep(k, v)}
            if not value:
                continue
            if kind == "optimizer":
                kind = "value"
        frozen = _frozen(kind, value) if defer and fsdp is None else None
        if frozen is not None:
            out.later(key, kind, *frozen)
        else:
            out.now(key, kind, value)
    return out


class _Sink:
    """The tensors of one state as the encoder hands them over (``on_tensor``), entry by entry."""

    def __init__(self) -> None:
        self.items: list[TensorItem] = []  # of the entry being encoded
        self.shards: dict[int, tuple[Layout, torch.Tensor]] = {}  # stand-in id -> (FSDP1 layout, stand-in)
        self.taken: set[str] = set()
        self.strategies: set[str] = set()
        self.substitutes: dict[int, torch.Tensor] = {}  # id(a frozen copy's tensor) -> what to save in its place

    def on_tensor(self, path: str, t: torch.Tensor) -> str:
        name = path
        n = 1
        while name in self.taken:
            n += 1
            name = f"{path}#{n}"
        self.taken.add(name)
        if t.dtype not in SAFETENSORS_DTYPES:
            raise UnsafeValueError(f"{path!r}: dtype {t.dtype} cannot be stored (format v3, docs/format.md section 6)")
        if self.substitutes:
            t = self.substitutes.get(id(t), t)
        shard = self.shards.get(id(t)) if self.shards else None
        kind = type(t)
        if shard is None and kind in _PLAIN:  # the common case, without working out a layout
            # a plain tensor outside autograd (a state dict's) is its own detached view
            data = t if kind is torch.Tensor and not t.requires_grad else t.detach()
            shape = tuple(data.shape)
            self.items.append(TensorItem(name, data, shape, (0,) * len(shape), True, True))
            return name
        placed = shard is not None or is_sharded(t) or is_sharded_tensor(t)
        self.items.append(_item(name, shard[0] if shard is not None else layout_of(t), placed))
        if not self.items[-1].replicated:
            self.strategies.add("fsdp")
        return name


class Captured:
    """A state as :func:`capture` read it: entries encoded (with their tensors) and entries frozen for
    :meth:`finish`, in the state's order."""

    def __init__(self, sink: _Sink, allow_pickle: bool, buffers: list[torch.Tensor]) -> None:
        self._sink = sink
        self._allow_pickle = allow_pickle
        self.buffers = buffers
        self._entries: list[tuple[str, str, Any, list[TensorItem] | None]] = []  # key, kind, value or JSON, items
        self.items: list[TensorItem] = []
        """The tensors of the entries encoded at the capture."""
        self.leaves: list[torch.Tensor] = []
        """The tensors of the frozen entries, as :meth:`finish` will find them."""

    def now(self, key: str, kind: str, value: Any) -> None:
        sink = self._sink
        sink.items = []
        encoded = encode(value, key, sink.on_tensor, allow_pickle=self._allow_pickle)
        self._entries.append((key, kind, encoded, sink.items))
        self.items += sink.items

    def later(self, key: str, kind: str, frozen: Any, leaves: list[torch.Tensor]) -> None:
        self._entries.append((key, kind, frozen, None))
        self.leaves += leaves

    def finish(self, substitutes: dict[int, torch.Tensor] | None = None) -> FlatState:
        """Encode the frozen entries (a leaf whose id is in ``substitutes`` saved as its value there: a
        copy made at the call) and return the whole state, as :func:`flatten` does."""
        sink = self._sink
        sink.substitutes = substitutes or {}
        objects: dict[str, dict[str, Any]] = {}
        items: list[TensorItem] = []
        for key, kind, value, encoded_items in self._entries:
            if encoded_items is None:
                sink.items = []
                value = encode(value, key, sink.on_tensor, allow_pickle=self._allow_pickle)
                encoded_items = sink.items
            objects[key] = {"kind": kind, "value": value}
            items += encoded_items
        sink.substitutes = {}
        strategies = sink.strategies
        strategy = "fsdp" if "fsdp" in strategies else ("ddp" if "ddp" in strategies else "plain")
        return FlatState(objects=objects, items=items, strategy=strategy, buffers=self.buffers)


_IMMUTABLE = (int, float, bool, str, type(None))


def _frozen(kind: str, value: Any) -> tuple[Any, list[torch.Tensor]] | None:
    """(a background save's call) A copy of a module's or an optimizer's ``value`` that later changes to
    the module or optimizer cannot reach, and its tensors, to be encoded after the call; ``None`` where
    the value holds anything else than plain tensors and immutable values (a module's extra state, a
    sharded tensor, a list an optimizer keeps in its state, a tensor of a dtype the format does not hold):
    that entry is encoded at the call. A tensor that the encoder would detach is detached here, so the
    tensors found then are these."""
    leaves: list[torch.Tensor] = []

    def leaf(v: Any) -> Any:
        kind_v = type(v)
        if kind_v in _PLAIN:
            if v.dtype not in SAFETENSORS_DTYPES:  # refused at the call, by the encoder, naming it
                raise _NotFrozen
            v = v if kind_v is torch.Tensor and not v.requires_grad else v.detach()
            leaves.append(v)
            return v
        if kind_v in _IMMUTABLE:
            return v
        if kind_v is tuple and all(type(x) in _IMMUTABLE for x in v):
            return v
        raise _NotFrozen

    try:
        if kind == "module" and isinstance(value, dict):
            return {k: leaf(v) for k, v in value.items()}, leaves
        if kind == "optimizer" and type(value) is dict and value.keys() == {"state", "param_groups"}:
            state = {k: {n: leaf(v) for n, v in s.items()} for k, s in value["state"].items()}
            groups = [{k: (list(v) if k == "params" else leaf(v)) for k, v in g.items()} for g in value["param_groups"]]
            return {"state": state, "param_groups": groups}, leaves
    except (_NotFrozen, AttributeError, TypeError):
        return None
    return None


class _NotFrozen(Exception):
    """(internal) A value :func:`_frozen` does not copy."""


def nested_states(value: Any, where: str, allow_pickle: bool = False, _level: int = 0) -> Any:
    """(every rank, locally) ``value`` with every object inside its dicts, lists, tuples and
    ``per_rank`` markers that has ``state_dict()``/``load_state_dict()`` replaced by its state dict, as
    a top-level one is (a scheduler in Lightning's ``{"scheduler": sched, "interval": "step"}``); the
    load hands it back through ``load_state_dict`` (state/restore.py). ``value`` itself when there is
    none. A module or an optimizer inside is refused: each is an entry of its own, saved under its
    parameter names and placed by the strategy (with ``allow_pickle`` it is left to be pickled)."""
    if _level > MAX_DEPTH:  # a container holding itself: the encoder refuses it by name
        return value
    level = _level + 1
    if isinstance(value, PerRank):
        inner = nested_states(value.value, where, allow_pickle, level)
        return value if inner is value.value else PerRank(inner)
    if isinstance(value, dict):
        items = {k: nested_states(v, f"{where}/{_step(k)}", allow_pickle, level) for k, v in value.items()}
        return value if all(items[k] is v for k, v in value.items()) else items
    if isinstance(value, list) or type(value) is tuple:
        seq = [nested_states(v, f"{where}/{i}", allow_pickle, level) for i, v in enumerate(value)]
        if all(a is b for a, b in zip(seq, value, strict=True)):
            return value
        return seq if isinstance(value, list) else tuple(seq)
    if isinstance(value, torch.Tensor):
        return value
    kind = kind_of(value)
    if kind in ("module", "optimizer") and not allow_pickle:
        raise InvalidTypeError(
            f"{where!r}: a {kind} ({type(value).__name__}) inside an entry of the state; put it at the top level "
            f"of the state (state = {{'{kind}': obj, ...}}): a {kind} is saved as an entry of its own, under its "
            "parameter names and as the strategy placed its tensors"
        )
    return nested_states(value.state_dict(), where, allow_pickle, level) if kind == "stateful" else value


def _step(key: Any) -> str:
    """A dict key as a step of a path in messages; an integer too long for ``str`` (the encoder refuses it
    by name) as its size."""
    if isinstance(key, int) and key.bit_length() > 10_000:
        return f"<an integer of {key.bit_length()} bits>"
    return str(key)


def _item(name: str, layout: Layout, placed: bool) -> TensorItem:
    if layout.replicated:
        (offsets, local), *_ = layout.boxes
        return TensorItem(name, local, layout.shape, offsets, True, True, placed)
    if len(layout.boxes) == 1:
        offsets, local = layout.boxes[0]
        return TensorItem(name, local, layout.shape, offsets, False, layout.owner, placed, None, layout.rule)
    first = layout.boxes[0][1] if layout.boxes else torch.empty(0, dtype=layout.dtype)
    offsets = layout.boxes[0][0] if layout.boxes else (0,) * len(layout.shape)
    return TensorItem(name, first, layout.shape, offsets, False, layout.owner, placed, list(layout.boxes), layout.rule)


def _stand_ins(value: dict[str, Any], shards: dict[int, tuple[Layout, torch.Tensor]]) -> dict[str, Any]:
    """FSDP1 layouts in a module or optimizer value (nested dicts) replaced by empty stand-in tensors,
    which the typed-JSON encoder hands to ``on_tensor`` like any tensor; ``shards`` maps them back."""

    def swap(v: Any) -> Any:
        if isinstance(v, Layout):
            token = torch.empty(0, dtype=v.dtype)
            shards[id(token)] = (v, token)  # holding the stand-in keeps its id unique
            return token
        if isinstance(v, dict) and any(isinstance(x, (Layout, dict)) for x in v.values()):
            return {k: swap(x) for k, x in v.items()}
        return v

    return swap(value)  # type: ignore[no-any-return]


def exchange_payload(state: Mapping[str, Any]) -> str:
    """(every rank, before a save's rendezvous) What this rank contributes to the FSDP1 exchange of
    :func:`flatten` (JSON), or ``""`` when the state needs none (no FSDP1 optimizer over original
    parameters). The save sends it in its first agreement and hands every rank's to ``flatten``."""
    captured: list[str] = []

    def capture(_phase: str, payload: str) -> list[str]:
        captured.append(payload)
        return [payload]

    if isinstance(state, Mapping):
        _fsdp1_state(state, capture)
    return captured[0] if captured else ""


def _fsdp1_state(
    state: Mapping[str, Any], gather: fsdp1.Gather | None, keys: set[str] | None = None
) -> fsdp1.Fsdp1State | None:
    """FSDP1 hook (state/fsdp1.py): the FSDP1 modules of ``state`` and, for optimizers over their
    original parameters, the state structure exchanged through ``gather``. ``keys``: the keys of the
    modules holding FSDP1 units, where a walk found them already."""
    modules = modules_of(state)
    roots = {k: m for k, m in modules if (k in keys if keys is not None else fsdp1.is_fsdp1(m))}
    if not roots:
        return None
    fsdp = fsdp1.Fsdp1State(roots, multi=len(modules) > 1)
    optimizers = [v.obj if isinstance(v, Filtered) else v for v in state.values()]
    optimizers = [o for o in optimizers if isinstance(o, torch.optim.Optimizer) and fsdp.touches(o)]
    if any(id(p) in fsdp.by_orig for o in optimizers for g in o.param_groups for p in g["params"]):
        fsdp.exchange(optimizers, gather or (lambda _phase, payload: [payload]))
    return fsdp
