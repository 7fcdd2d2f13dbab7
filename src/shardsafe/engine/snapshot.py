"""Background staging (``async_save(..., staging="background")``): the call returns before copying any
tensor, and the checkpoint still holds the values at the call, or the save fails; it is never torn.

At the call (:class:`BackgroundStaging`, the caller's thread), right after the state is flattened
(its plain values encoded) and before anything else of the save (the rendezvous, the plan and the
staging memory all come later, on the save's thread):

- **module buffers are cloned** on their own device (BatchNorm running statistics and the like). They
  are small (a few KiB per layer, well under 1% of a model), a forward changes them, and the kernels
  that change them (``native_batch_norm``) do not move their version counter, so they could neither be
  waited for cheaply (a forward pre-hook would hold up every forward of the model for its whole
  staging) nor checked: copying them at once is the one choice both cheap and exact;
- **every other tensor's version counter** (``tensor._version``, shared by views and ``detach()``) is
  recorded, and on an accelerator an event marks the work queued on the current stream (the copies
  are ordered after it, not after what the training queues later);
- **optimizers found in the state are gated**: their next ``optimizer.step()`` waits until the chunks
  of their parameters and state are copied; a parameter is immutable until the step, so the step that
  follows the call never runs ahead of the copy. The wait is bounded by the save's work deadline; past
  it the step goes on, and the version check below fails the save rather than tear it. The gate is
  disarmed when staging ends, however it ends. It is one step pre-hook per optimizer
  (``register_step_pre_hook``), installed by the first background save of that optimizer and left
  registered, disarmed, afterwards (it then returns at once): removing a hook from the staging thread
  while the training thread's ``step()`` iterates the optimizer's hooks raises "OrderedDict mutated
  during iteration" in the training step, so no hook is ever removed from another thread.

On the save's background thread, once the save's start is agreed and this rank's chunks are planned
(:meth:`BackgroundStaging.plan`), before the write (:meth:`BackgroundStaging.run`): the chunks are
copied into the slab, those the next optimizer step touches first (parameters and state of the
optimizers, in their order), then the rest in file order; CPU sources by single-threaded ``memmove``
pieces (with every intra-op thread while an optimizer step waits for them), accelerator sources on
the device's side stream (created at CUDA's lowest priority, the default), each ordered after the
work queued on the current stream at the call. After each chunk's copy has landed, its version
counter is compared with the one at the call: a change means the tensor was written in place in
between, and the save fails on every rank with :class:`TornSnapshotError` naming the tensor (through
the commit round, as any failure of a rank), nothing is committed and the previous checkpoint at the
path stays loadable. The chunks an incremental save refers to instead of writing (equal to the
base's, compared on the save's thread) are checked the same way once compared
(:meth:`BackgroundStaging.check_unchanged`).

What it cannot see (docs/async.md): writes that bypass the version counter (``tensor.data.add_()``,
kernels that mutate an argument without declaring it, as BatchNorm's running statistics in a plain
``model.state_dict()`` dict rather than the module), and a CPU in-place operation on another thread that
is still running when the tensor's copy ends (the counter moves when the operation ends). Use
``staging="blocking"`` for state changed that way.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shardsafe.deadline import Deadline
from shardsafe.engine import hostmem, staging
from shardsafe.engine.plan import PendingChunk
from shardsafe.errors import TornSnapshotError
from shardsafe.format.values import PerRank
from shardsafe.state.flatten import Filtered, FlatState, TensorItem

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]

logger = logging.getLogger(__name__)

StorageKey = tuple[str, int | None, int]


@dataclass
class _Guard:
    """One optimizer of the state in one save: the chunks its next step writes, and whether they are
    copied."""

    name: str
    optimizer: torch.optim.Optimizer
    pending: set[int] = field(default_factory=set)  # this rank's chunks of its parameters and state not yet copied
    ready: threading.Event = field(default_factory=threading.Event)
    wait: Callable[[], None] | None = None  # armed on the optimizer's gate until ready


class _Gate:
    """The step pre-hook shardsafe installs once per optimizer: runs the waits armed on it (one per
    save still staging that optimizer's tensors), and returns at once when none is."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.armed: list[Callable[[], None]] = []

    def __call__(self, _opt: Any, _args: Any, _kwargs: Any) -> None:
        with self.lock:
            armed = list(self.armed)
        for wait in armed:
            wait()

    def arm(self, wait: Callable[[], None]) -> None:
        with self.lock:
            self.armed.append(wait)

    def disarm(self, wait: Callable[[], None]) -> None:
        with self.lock:
            self.armed = [w for w in self.armed if w is not wait]


_gates: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Gate] = weakref.WeakKeyDictionary()
_gates_lock = threading.Lock()


def gate_of(opt: torch.optim.Optimizer) -> _Gate:
    """(the caller's thread) The optimizer's gate, installed on first use."""
    with _gates_lock:
        gate = _gates.get(opt)
        if gate is None:
            gate = _gates[opt] = _Gate()
            opt.register_step_pre_hook(gate)
        return gate


def _storage_key(t: torch.Tensor) -> StorageKey | None:
    """Which memory ``t`` lives in (a DTensor: its local shard's), to match chunks with the tensors an
    optimizer or a module owns; ``None`` for tensors without memory."""
    if DTensor is not None and isinstance(t, DTensor):
        t = t._local_tensor
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return (t.device.type, t.device.index, ptr) if ptr else None


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter; ``None`` where it has none (inference tensors)."""
    try:
        return int(t._version)
    except RuntimeError:
        return None


def _optimizers(state: Mapping[str, Any]) -> list[tuple[str, torch.optim.Optimizer]]:
    out = []
    for key, entry in state.items():
        obj = entry.obj if isinstance(entry, Filtered) else entry
        obj = obj.value if isinstance(obj, PerRank) else obj
        if isinstance(obj, torch.optim.Optimizer):
            out.append((key, obj))
    return out


def _optimizer_keys(opt: torch.optim.Optimizer) -> set[StorageKey]:
    keys: set[StorageKey | None] = set()
    for group in opt.param_groups:
        keys.update(_storage_key(p) for p in group["params"])
    for st in opt.state.values():
        if isinstance(st, Mapping):
            keys.update(_storage_key(v) for v in st.values() if isinstance(v, torch.Tensor))
    return {k for k in keys if k is not None}


class BackgroundStaging:
    """The background staging of one rank's share of one save; see the module docstring.

    Made at the call from the flattened state (:meth:`__init__`: version counters recorded, module
    buffers cloned into the state's items), then :meth:`attach` arms the optimizers' gates before the
    call returns. On the save's thread, once the chunks are planned:
    :meth:`plan` (the copy order; also called at the call where the plan is made there),
    :meth:`check_unchanged` for chunks the save refers to instead of copying, :meth:`run` with the
    :class:`Staged` of :attr:`chunks`. :meth:`close` in every case (idempotent; :meth:`run` calls it).
    :attr:`done` is set once staging has ended, copied or failed."""

    def __init__(
        self,
        items: Sequence[TensorItem],
        leaves: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        state: Mapping[str, Any],
        *,
        path: str,
        rank: int,
    ) -> None:
        """``items``: the tensors of the state's encoded entries; ``leaves``: those of its entries encoded
        after the call (:class:`~shardsafe.state.flatten.Captured`), whose copies made here are in
        :attr:`substitutes`; ``buffers``: the state's module buffers."""
        self.path = path
        self.rank = rank
        self.done = threading.Event()
        self.cloned = 0  # bytes copied at the call (module buffers)
        self.waited = 0.0  # seconds optimizer steps spent waiting for this staging (all gates)
        self._waiting = 0  # optimizer steps waiting now: the CPU copies then take every core
        buffer_keys = {_storage_key(b) for b in buffers}
        buffer_keys.discard(None)
        # id(item.local) -> the item's tensors and their versions at the call (the items stay referenced by
        # ``flat`` until the plan, and the per-rank items made from them share their ``local``)
        self._recorded: dict[int, list[tuple[torch.Tensor, int]]] = {}
        self._recorded_by_name: dict[str, list[tuple[torch.Tensor, int]]] = {}  # by tensor name, once planned
        self._names: dict[int, str] = {}  # id(item.local) -> the tensor's name in the state, for messages
        self._called: dict[str, str] = {}  # a planned chunk's tensor name -> that name (per-rank ones differ)
        self.marks: dict[tuple[str, int], Any] = {}  # accelerator: the current stream's work at the call
        devices: dict[tuple[str, int], torch.device] = {}
        self.substitutes: dict[int, torch.Tensor] = {}  # id(a leaf) -> its copy, saved in its place
        for item in items:
            self._capture(item, buffer_keys, devices)
        for leaf in leaves:
            self._capture_leaf(leaf, buffer_keys, devices)
        for key, device in devices.items():  # after the clones: the copies and reads come after them too
            self.marks[key] = hostmem.mark_current(device)
        self.guards = [_Guard(name, opt) for name, opt in _optimizers(state)]
        self.chunks: list[PendingChunk] = []
        self.sources: list[list[tuple[torch.Tensor, int]]] = []  # per chunk, until its copy is checked
        self.order: list[int] = []
        self._lock = threading.Lock()
        self._closed = False
        self.deadline: Deadline | None = None

    def _capture(
        self, item: TensorItem, buffers: set[StorageKey | None], devices: dict[tuple[str, int], torch.device]
    ) -> None:
        """(the call) Record the versions of ``item``'s tensors; clone those without one (inference
        tensors) or that are a module's buffers, in place of the originals in ``item``; note the
        accelerators they are on in ``devices``."""
        if item.pieces is None and not buffers:  # one box, no buffer to clone: the common case
            t = item.local
            version = _version(t)
            if version is not None and not t.is_cuda:
                self._recorded[id(t)] = [(t, version)]
                self._names[id(t)] = item.name
                return
        recorded: list[tuple[torch.Tensor, int]] = []
        boxes = item.boxes()
        cloned = False
        for n, (offsets, t) in enumerate(boxes):
            if t.is_cuda:
                devices.setdefault(hostmem.device_key(t.device), t.device)
            version = _version(t)
            if version is None or (buffers and _storage_key(t) in buffers):
                copy = t.detach().clone()  # on its own device and stream
                self.cloned += copy.nbytes
                boxes[n] = (offsets, copy)
                cloned = True
            else:
                recorded.append((t, version))
        if cloned:
            if item.pieces is not None:
                item.pieces = boxes
                item.local = boxes[0][1] if boxes else item.local
            else:
                item.local = boxes[0][1]
        self._recorded[id(item.local)] = recorded
        self._names[id(item.local)] = item.name

    def _capture_leaf(
        self, t: torch.Tensor, buffers: set[StorageKey | None], devices: dict[tuple[str, int], torch.device]
    ) -> None:
        """(the call) :meth:`_capture` of a tensor the encoder has not named yet (it will be an item's
        ``local``): its version recorded, or a copy of it made and kept in :attr:`substitutes`."""
        if t.is_cuda:
            devices.setdefault(hostmem.device_key(t.device), t.device)
        version = _version(t)
        if version is None or (buffers and _storage_key(t) in buffers):
            copy = t.detach().clone()
            self.cloned += copy.nbytes
            self.substitutes[id(t)] = copy
            self._recorded[id(copy)] = []
        else:
            self._recorded[id(t)] = [(t, version)]

    def plan(self, flat: FlatState, chunks: Sequence[PendingChunk]) -> None:
        """(the save's thread; the call's where the save plans there) This rank's planned ``chunks`` of
        ``flat`` (made from the items :meth:`__init__` captured) become :attr:`chunks`: those the
        optimizers' next steps touch first, in the optimizers' order, then the rest. An optimizer with
        nothing to copy on this rank is released at once."""
        items = (*flat.items, *flat.per_rank)
        recorded = {i.name: self._recorded.get(id(i.local), []) for i in items}
        self._called = {i.name: self._names.get(id(i.local), i.name) for i in items}
        self.chunks = list(chunks)
        self.sources = [recorded.get(c.name, []) for c in self.chunks]
        keys = [_storage_key(c.data) if src else None for c, src in zip(self.chunks, self.sources, strict=True)]
        first: list[int] = []
        taken: set[int] = set()
        for g in self.guards:
            owned = _optimizer_keys(g.optimizer)  # its step waits at the gate: the set stays as it is
            g.pending = {i for i, k in enumerate(keys) if k is not None and k in owned}
            first += sorted(g.pending - taken)
            taken |= g.pending
            if not g.pending:
                self._release(g)
        self.order = first + [i for i in range(len(self.chunks)) if i not in taken]
        self._recorded_by_name = recorded

    def check_unchanged(self, names: Sequence[str]) -> None:
        """(the save's thread, after the plan) The tensors ``names`` are not copied (the save refers to a
        base's equal chunks, compared after the call): raise :class:`TornSnapshotError` if one changed
        since the call."""
        for name in names:
            for src, before in self._recorded_by_name.get(name, []):
                self._check(name, src, before)

    def attach(self, deadline: Deadline) -> None:
        """(the caller's thread, before ``async_save`` returns) Arm the gates of the optimizers whose
        chunks this rank copies: their next step waits for those chunks, until ``deadline`` at most."""
        self.deadline = deadline
        for g in self.guards:
            if not g.ready.is_set():
                g.wait = self._waiter(g)
                gate_of(g.optimizer).arm(g.wait)

    def _waiter(self, g: _Guard) -> Callable[[], None]:
        def wait_for_staging() -> None:
            if g.ready.is_set():
                return
            assert self.deadline is not None
            start = time.monotonic()
            with self._lock:
                self._waiting += 1
            try:
                ok = g.ready.wait(self.deadline.remaining())
            finally:
                with self._lock:
                    self._waiting -= 1
                    self.waited += time.monotonic() - start
            if not ok:
                logger.warning(
                    "shardsafe: rank %d: optimizer %r stepped before the background staging of %s copied its "
                    "tensors (waited until the save's deadline); the save fails with TornSnapshotError if the "
                    "step changed one of them",
                    self.rank,
                    g.name,
                    self.path,
                )

        return wait_for_staging

    def _release(self, g: _Guard) -> None:
        g.ready.set()
        if g.wait is not None:
            gate_of(g.optimizer).disarm(g.wait)
            g.wait = None

    def run(self, staged: staging.Staged, fault: Callable[[], None]) -> None:
        """(the save's background thread) Copy every chunk into ``staged``'s slab in :attr:`order`,
        checking each one's version after its copy; raise :class:`TornSnapshotError` for the first that
        changed. Disarms the gates however it ends."""
        try:
            fault()
            staging.fill(staged, self.order, self._landed, lambda: self._waiting == 0)
        finally:
            self.close()

    def _landed(self, i: int) -> None:
        sources, self.sources[i] = self.sources[i], []
        for src, before in sources:
            self._check(self.chunks[i].name, src, before)
        for g in self.guards:
            if i in g.pending:
                g.pending.discard(i)
                if not g.pending:
                    self._release(g)

    def _check(self, name: str, src: torch.Tensor, before: int) -> None:
        if int(src._version) != before:
            name = self._called.get(name, name)
            raise TornSnapshotError(
                f"async_save of {self.path!r} (staging='background'): tensor {name!r} was changed in place on "
                f"rank {self.rank} after the call and before it was copied (version {before} -> {int(src._version)}); "
                "nothing was committed and the previous checkpoint at the path is untouched. Put the optimizer that "
                "changes it in the state (its step then waits for the copy), change it only after "
                "handle.wait_staged(), or save with staging='blocking'"
            )

    def close(self) -> None:
        """(any thread, idempotent) Staging is over: disarm the gates, release waiting steps."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for g in self.guards:
            self._release(g)
        self.sources = []
        self._recorded = {}
        self._recorded_by_name = {}
        self._names = {}
        self.chunks = []  # the save keeps the staged copies; no reference to the caller's tensors
        self.done.set()
