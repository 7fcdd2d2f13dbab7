"""Loading into the caller's state in place, as torch.distributed.checkpoint does (docs/design.md,
principle 7). (every rank, locally) A :class:`Restorer` walks the caller's state beside the
checkpoint's typed JSON and plans; it modifies nothing until :meth:`Restorer.apply`:

- a tensor (a DTensor: its local shard; a ShardedTensor: its local shards) that meets a ``tensor``
  node is filled in place: same object, storage, device and dtype; so is a :class:`Layout`, a tensor
  held as several boxes (an FSDP1 parameter: views of this rank's flat shard, state/fsdp1.py). A
  shape mismatch, or a dtype mismatch without ``cast=True``, raises;
- a dict, list or tuple that meets a node of the same kind is matched entry by entry (a tuple is
  rebuilt, being immutable); a key of the state that the checkpoint lacks is *missing*, a key only
  the checkpoint has is added;
- anything else (plain values, a container of another kind or length without tensors) is replaced
  by the saved value, decoded into new objects (tensors on CPU, or on ``device``);
- a module, and an object with ``state_dict()``/``load_state_dict()`` (DCP's Stateful protocol), gives
  its state dict, which is filled as above and handed back through ``load_state_dict`` after the reads;
  optimizers: state/restore_optim.py;
- a ``per_rank`` node gives this rank's value when the checkpoint was saved by as many ranks; on
  another world size the value is missing (docs/format.md, "Per-rank values").

Call order: ``plan_entry``/``extra`` for each entry; then (after the size checks of :meth:`names`)
:meth:`prepare`, which allocates the new tensors and returns the boxes to fill (global offsets and a
view of the destination), early ones apart, from which the engine plans its reads; after the early
reads (into new tensors only) :meth:`check`, which may still refuse the load; then the go/no-go;
then, after the other reads, :meth:`apply`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch

from shardsafe.errors import CorruptCheckpointError, StateMismatchError
from shardsafe.format.manifest import Manifest
from shardsafe.format.sharding import Region
from shardsafe.format.values import PerRank, decode, dtype_name
from shardsafe.format.walk import has_per_rank
from shardsafe.state.flatten import kind_of, load_module_state, module_state
from shardsafe.state.layout import Box, Layout, layout_of
from shardsafe.state.nodes import align, cpu_alloc, describe, describe_value, holds_tensor, refs, tag_of
from shardsafe.state.rng import RNGState

logger = logging.getLogger(__name__)

Op = Callable[[], Any]
"""Run after the reads: applies a subtree's changes and returns the value its parent holds."""


_ABSENT: Any = object()  # what a per-rank value saved by another world size selects: nothing (missing)


@dataclass
class _Decode:
    node: Any
    where: str
    value: Any = None


class Restorer:
    """Plans a load into ``state`` of one rank (``rank`` of ``world_size``); see the module docstring."""

    def __init__(
        self,
        manifest: Manifest,
        path: str,
        *,
        rank: int | None,
        world_size: int,
        cast: bool,
        device: torch.device | None,
        allow_pickle: bool,
    ) -> None:
        self.manifest = manifest
        self.path = path
        self.rank = rank  # None: no rank of its own (load(path) without a state)
        self.world_size = world_size
        self.cast = cast
        self.device = device
        self.allow_pickle = allow_pickle
        self.missing: list[str] = []
        self.steps: list[Callable[[], None]] = []
        self._fills: list[tuple[str, Layout]] = []  # (manifest name, this rank's boxes of the destination)
        self._in_place = False  # some destination belongs to the caller's state
        self._fresh: dict[str, Callable[[], torch.Tensor]] = {}  # manifest name -> allocator (after size checks)
        self._fresh_bytes: dict[str, int] = {}  # manifest name -> bytes its new tensor takes
        self._regions: dict[str, list[Region] | None] = {}  # manifest name -> boxes it fills (None: whole)
        self._early: set[str] = set()  # new tensors read before the go/no-go, for :attr:`checks`
        self._decodes: list[_Decode] = []
        self.tensors: dict[str, torch.Tensor] = {}  # allocated by prepare()
        self.cpu_only = False  # new tensors on CPU whatever ``device`` says (optimizer state)
        self.checks: list[Callable[[], None]] = []
        """Run by :meth:`check` after the early reads, before the go/no-go: raise to refuse the load."""

    # ------------------------------------------------------------------------------- entries

    def plan_entry(self, key: str, obj: Any, state: MutableMapping[str, Any]) -> None:
        """Plan loading entry ``key`` of the checkpoint into ``state[key]`` (``obj``)."""
        saved = self.manifest.objects[key]
        node, kind, skind = saved["value"], kind_of(obj), saved["kind"]
        if kind == "module":
            self._expect(key, skind, ("module", "value"), "module")
            module = obj.value if isinstance(obj, PerRank) else obj
            sd = module_state(module)
            op = self._merge_dict(
                sd, self._dict_node(node, key, skind, "a module's state dict"), key, lenient=False, module=True
            )
            self.steps.append(lambda: load_module_state(module, op()))
        elif kind == "optimizer":
            from shardsafe.state.restore_optim import plan_optimizer

            self._expect(key, skind, ("optimizer",), "optimizer")
            plan_optimizer(self, key, obj.value if isinstance(obj, PerRank) else obj, node, state)
        elif kind == "stateful":
            self._expect(key, skind, ("stateful", "value"), "object with state_dict()/load_state_dict()")
            target = obj.value if isinstance(obj, PerRank) else obj
            rng = isinstance(target, RNGState)
            node = self._select(node, key, keep=rng and target.per_rank == "drop")
            if node is _ABSENT:
                return
            sd = {} if rng else target.state_dict()  # generators are set from new objects, whatever they are now
            if isinstance(sd, dict):  # a saved value of another kind would fail in load_state_dict, after the reads
                node = self._dict_node(node, key, skind, "a state dict")
            op = self.merge(sd, node, key)
            self.steps.append(lambda: target.load_state_dict(op()))
        else:
            if skind == "optimizer" and isinstance(obj, dict):
                raise StateMismatchError(
                    f"{self.path}: entry {key!r} was saved from an optimizer (its state keyed by parameter names); "
                    "pass the optimizer object itself (beside its model) to load it into, or load(path) to read it."
                )
            op = self.merge(obj, node, key, module=skind == "module")

            def put() -> None:
                state[key] = op()

            self.steps.append(put)

    def extra(self, key: str) -> Op:
        """An entry the state did not ask for: read whole into new objects. Per-rank values give this
        rank's value on the saved world size, else ``{rank: value}``."""
        op = self.replace(self.manifest.objects[key]["value"], key, whole=True)
        assert op is not None  # whole=True keeps per-rank values
        return op

    def _expect(self, key: str, saved: str, allowed: tuple[str, ...], what: str) -> None:
        if saved not in allowed:
            raise StateMismatchError(
                f"{self.path}: entry {key!r} was saved as a {saved}, but a {what} asks for it; pass a matching "
                "object, or load(path) to read the entry as it was saved"
            )

    def _dict_node(self, node: Any, where: str, kind: str, what: str) -> dict[str, Any]:
        if not (isinstance(node, dict) and node.get("$") == "dict"):
            message = f"{self.path}: {where}: expected {what} (a dict), found {describe(node)}"
            if kind == "value":  # saved that way: the state asks for something else
                raise StateMismatchError(message)
            raise CorruptCheckpointError(message)  # a module or stateful entry is written as a dict
        return node

    # ------------------------------------------------------------------------------- the walk

    def merge(self, dest: Any, node: Any, where: str, *, lenient: bool = False, module: bool = False) -> Op:
        """Plan loading ``node`` into ``dest`` in place. ``lenient`` (optimizer state): keys only the
        state has are not missing, and a tensor of another dtype or kind is replaced, not refused."""
        node = self._select(node, where)
        if node is _ABSENT:
            return lambda: dest
        if isinstance(dest, PerRank):
            inner = self.merge(dest.value, node, where, lenient=lenient, module=module)

            def put_inner() -> PerRank:
                dest.value = inner()
                return dest

            return put_inner
        tag = tag_of(node)
        if isinstance(dest, Layout):  # a tensor held as boxes (FSDP1 parameters: views of the flat shard)
            if tag != "tensor":
                raise StateMismatchError(
                    f"{self.path}: {where}: the state holds a tensor here, the checkpoint {describe(node)}; "
                    "the state and the checkpoint have different structures"
                )
            self.fill(node["ref"], dest, where)
            return lambda: dest
        if isinstance(dest, torch.Tensor):
            if tag in ("tensor", "ndarray"):
                entry = self.manifest.tensors[node["ref"]]
                if not lenient or entry.dtype == dest.dtype or entry.shape != tuple(dest.shape):
                    self.fill(node["ref"], dest, where)
                    return lambda: dest
                # optimizer state of another dtype: a new tensor placed like the old one (DTensor too)
                return self.fresh(node["ref"], lambda: torch.empty_like(dest, dtype=entry.dtype), like=dest)
            if not lenient:
                raise StateMismatchError(
                    f"{self.path}: {where}: the state holds a tensor here, the checkpoint {describe(node)}; "
                    "the state and the checkpoint have different structures"
                )
        elif isinstance(dest, dict) and tag == "dict":
            return self._merge_dict(dest, node, where, lenient=lenient, module=module)
        elif isinstance(dest, list) and tag == "list" and len(dest) == len(node):
            ops = [
                self.merge(d, n, f"{where}/{i}", lenient=lenient)
                for i, (d, n) in enumerate(zip(dest, node, strict=True))
            ]

            def put_list() -> list[Any]:
                for i, op in enumerate(ops):
                    dest[i] = op()
                return dest

            return put_list
        elif type(dest) is tuple and tag == "tuple" and len(dest) == len(node["items"]):
            items = [
                self.merge(d, n, f"{where}/{i}", lenient=lenient)
                for i, (d, n) in enumerate(zip(dest, node["items"], strict=True))
            ]
            return lambda: tuple(op() for op in items)
        elif tag != "pickle" and kind_of(dest) != "value":  # an object with state_dict() inside an entry
            return self._merge_object(dest, node, where)
        elif holds_tensor(dest) and not lenient:
            raise StateMismatchError(
                f"{self.path}: {where}: the state holds {describe_value(dest)} with tensors here, the checkpoint "
                f"{describe(node)}; the state and the checkpoint have different structures"
            )
        new = self.replace(node, where)
        return (lambda: dest) if new is None else new

    def _merge_object(self, dest: Any, node: Any, where: str) -> Op:
        """An object with ``state_dict()``/``load_state_dict()`` nested in an entry (state/flatten.py
        ``nested_states``): its state dict filled as above, handed back after the reads; same object."""
        kind = kind_of(dest)
        if kind != "stateful":
            raise StateMismatchError(
                f"{self.path}: {where}: a {kind} inside an entry of the state; put it at the top level of the "
                "state, where modules and optimizers are loaded (and saved)"
            )
        sd = dest.state_dict()
        if isinstance(sd, dict):
            node = self._dict_node(node, where, "value", "a state dict")
        op = self.merge(sd, node, where)

        def put() -> Any:
            dest.load_state_dict(op())
            return dest

        return put

    def _merge_dict(self, dest: dict[Any, Any], node: dict[str, Any], where: str, *, lenient: bool, module: bool) -> Op:
        saved = {k: v for k, v in node["items"]}
        match = align(list(dest), list(saved)) if module else {k: k for k in dest if k in saved}
        ops: list[tuple[Any, Op]] = []
        for k, v in dest.items():
            if k in match:
                ops.append((k, self.merge(v, saved[match[k]], f"{where}/{k}", lenient=lenient)))
            elif not lenient:
                self.missing.append(f"{where}/{k}")
        used = set(match.values())
        for k, v in saved.items():
            if k in used:
                continue
            if module:  # a parameter the model does not have: never added to its state dict
                self.missing.append(f"{where}: unexpected {k}")
                continue
            new = self.replace(v, f"{where}/{k}")
            if new is not None:
                ops.append((k, new))

        def put() -> dict[Any, Any]:
            for k, op in ops:
                dest[k] = op()
            return dest

        return put

    def fill(self, name: str, dest: torch.Tensor | Layout, where: str, *, private: bool = False) -> None:
        """Plan reading tensor ``name`` into ``dest`` in place: a tensor (a DTensor: its local shard; a
        ShardedTensor: its local shards), or a :class:`Layout`, this rank's boxes of a tensor held in
        pieces (FSDP1). ``private``: ``dest`` is new, not the caller's."""
        entry = self.manifest.tensors[name]
        layout = dest if isinstance(dest, Layout) else layout_of(dest, roles=False)
        if layout.shape != entry.shape:
            raise StateMismatchError(
                f"{self.path}: {where}: shape mismatch: the checkpoint holds {list(entry.shape)}, the destination is "
                f"{list(layout.shape)}. Build the model with the same configuration as the saved one."
            )
        if layout.dtype != entry.dtype and not self.cast:
            raise StateMismatchError(
                f"{self.path}: {where}: dtype mismatch: the checkpoint holds {dtype_name(entry.dtype)}, the "
                f"destination is {dtype_name(layout.dtype)}. Pass cast=True to convert while loading, or load into "
                "a tensor of the saved dtype."
            )
        for _, data in layout.boxes:
            if data.device.type == "meta":
                raise StateMismatchError(
                    f"{self.path}: {where}: the destination is on the meta device (no storage to fill); "
                    "materialise the model first (e.g. model.to_empty(device=...)) and load again"
                )
            if data.is_inference() or any(s == 0 and n > 1 for s, n in zip(data.stride(), data.shape, strict=True)):
                raise StateMismatchError(
                    f"{self.path}: {where}: the destination cannot be written in place (an inference tensor, or an "
                    "expanded view whose elements share memory); put a plain tensor there"
                )
        self._fills.append((name, layout))
        self._add_regions(name, [(o, tuple(d.shape)) for o, d in layout.boxes])
        self._in_place = self._in_place or not private

    def fresh(
        self,
        name: str,
        alloc: Callable[[], torch.Tensor] | None = None,
        *,
        early: bool = False,
        like: torch.Tensor | None = None,
    ) -> Op:
        """Plan reading tensor ``name`` into a new tensor (``alloc``, default: CPU or ``device``);
        ``early``: read before the go/no-go, so that :attr:`checks` can look at it; ``like``: the tensor
        ``alloc`` shapes the new one after (its local shard sizes the memory check, not the global shape)."""
        entry_bytes = self.manifest.tensors[name].nbytes
        if like is not None:
            boxes = layout_of(like, roles=False).boxes
            held = sum(data.numel() for _, data in boxes)
            entry_bytes = held * self.manifest.tensors[name].dtype.itemsize
            self._add_regions(name, [(o, tuple(d.shape)) for o, d in boxes])
        else:
            self._add_regions(name, None)
        self._fresh_bytes[name] = entry_bytes
        if alloc is None:
            entry = self.manifest.tensors[name]

            def alloc() -> torch.Tensor:
                return torch.empty(entry.shape, dtype=entry.dtype, device=self.device)

        self._fresh[name] = alloc
        if early:
            self._early.add(name)
        return lambda: self.tensors[name]

    def replace(self, node: Any, where: str, *, whole: bool = False, early: bool = False) -> Op | None:
        """Plan decoding ``node`` into new objects (its tensors read into new tensors, before the
        go/no-go if ``early``); ``None`` when it holds a per-rank value this rank has none of
        (recorded as missing)."""
        node = self._select_all(node, where, whole)
        if node is _ABSENT:
            return None
        todo = _Decode(node, where)
        for tag, ref in refs(node):  # numpy needs CPU tensors, and so does optimizer state (torch moves it)
            cpu = tag == "ndarray" or self.cpu_only
            self.fresh(ref, cpu_alloc(self.manifest, ref) if cpu else None, early=early)
        self._decodes.append(todo)
        return lambda: todo.value

    # ------------------------------------------------------------------------------- per rank

    def _select(self, node: Any, where: str, *, keep: bool = False) -> Any:
        """This rank's value of a ``per_rank`` node (missing on another world size; with ``keep``, the
        destination kept as it is, with a WARNING); other nodes as they are."""
        if not (isinstance(node, dict) and node.get("$") == "per_rank"):
            return node
        ranks = node["ranks"]
        if len(ranks) != self.manifest.world_size:
            raise CorruptCheckpointError(
                f"{self.path}: {where}: a per-rank value with {len(ranks)} ranks in a checkpoint saved by "
                f"{self.manifest.world_size}"
            )
        if self.rank is not None and self.world_size == self.manifest.world_size:
            return ranks[self.rank]
        if keep:
            logger.warning(
                "shardsafe: load of %s: %s was kept per rank by the %d-rank save and this load runs on %d rank(s): "
                "left as it is (RNGState(per_rank='drop'); per_rank='error' refuses the load instead)",
                self.path,
                where,
                self.manifest.world_size,
                self.world_size,
            )
            return _ABSENT
        self.missing.append(
            f"{where} (kept per rank by the {self.manifest.world_size}-rank save; this load runs on "
            f"{self.world_size} rank{'s' if self.world_size > 1 else ''})"
        )
        return _ABSENT

    def _select_all(self, node: Any, where: str, whole: bool) -> Any:
        """``node`` with every ``per_rank`` node inside replaced by this rank's value; when there is none
        of its own: ``{rank: value}`` for ``whole`` (an entry nobody asked for), else missing."""
        if not has_per_rank(node):
            return node
        if isinstance(node, dict) and node.get("$") == "per_rank":
            if whole and (self.rank is None or self.world_size != self.manifest.world_size):
                return node  # decodes to {rank: value}
            return self._select(node, where)
        if isinstance(node, list):
            items = [self._select_all(v, f"{where}/{i}", whole) for i, v in enumerate(node)]
            return _ABSENT if any(v is _ABSENT for v in items) else items
        if node.get("$") == "tuple":
            inner = self._select_all(node["items"], where, whole)
            return _ABSENT if inner is _ABSENT else {"$": "tuple", "items": inner}
        pairs = [[k, self._select_all(v, f"{where}/{k}", whole)] for k, v in node["items"]]
        return _ABSENT if any(v is _ABSENT for _, v in pairs) else {"$": "dict", "items": pairs}

    # ------------------------------------------------------------------------------- phases

    def names(self) -> list[str]:
        """Every manifest tensor this plan reads (for the size checks before :meth:`prepare`)."""
        return list(dict.fromkeys([n for n, _ in self._fills] + list(self._fresh)))

    def _add_regions(self, name: str, boxes: list[Region] | None) -> None:
        known = self._regions.get(name, [])
        self._regions[name] = None if boxes is None or known is None else known + boxes

    def regions(self) -> dict[str, list[Region] | None]:
        """Every manifest tensor this plan reads, with the global boxes it fills (``None``: the whole
        tensor, for a new tensor of the manifest's shape): a ruled tensor's data files are those
        these boxes meet."""
        return dict(self._regions)

    def fills_in_place(self) -> bool:
        """Whether this plan reads into tensors of the caller's state (not only into new ones)."""
        return self._in_place

    def fresh_bytes(self) -> dict[str, int]:
        """The manifest tensors this plan allocates anew (not filled into the caller's tensors), with
        the bytes each new tensor takes (a DTensor shard's local size, not the global one)."""
        return {name: self._fresh_bytes[name] for name in self._fresh}

    def prepare(self) -> tuple[list[tuple[str, Box]], list[tuple[str, Box]]]:
        """Allocate the new tensors, decode the new values and return what to fill, as (manifest
        tensor name, destination box) pairs: ``(early, rest)``. ``early`` fills only new tensors, for
        :meth:`check` before the go/no-go. Still modifies nothing of the caller's state."""
        for name, alloc in self._fresh.items():
            self.tensors[name] = alloc()
        for todo in self._decodes:
            todo.value = decode(
                todo.node, f"{self.path}: {todo.where}", self.tensors.__getitem__, allow_pickle=self.allow_pickle
            )
        early: list[tuple[str, Box]] = []
        rest: list[tuple[str, Box]] = []
        fresh = [(name, layout_of(t, roles=False), name in self._early) for name, t in self.tensors.items()]
        for name, layout, first in [*((n, lay, False) for n, lay in self._fills), *fresh]:
            for box in layout.boxes:
                (early if first else rest).append((name, box))
        return early, rest

    def check(self) -> None:
        """(after the early reads, before the go/no-go) Run :attr:`checks`."""
        for check in self.checks:
            check()

    def apply(self) -> None:
        """(after every read succeeded) Put the new values in place and hand state dicts back."""
        for step in self.steps:
            step()
