"""Background staging (``async_save(..., staging="background")``): the call returns before copying any
tensor, and the checkpoint still holds the values at the call, or the save fails; it is never torn.

At the call (:class:`BackgroundStaging`, the caller's thread), right after the state is captured and
before anything else of the save (rendezvous, plan and staging memory come later, on the save's thread):

- **module buffers are cloned** on their own device. A forward changes them (BatchNorm's running
  statistics) through kernels that move no version counter, so they could neither be waited for
  cheaply (a forward pre-hook would hold up every forward for the whole staging) nor checked; they are
  small (well under 1% of a model), so copying them at once is both cheap and exact;
- **every other tensor is recorded** (:mod:`shardsafe.engine.sources`: version counter, data pointer,
  first bytes on the CPU); on an accelerator an event marks the work queued on the current stream, and
  the copies are ordered after it, not after what the training queues later;
- **every optimizer step is gated** (:mod:`shardsafe.engine.stepgate`): before any ``optimizer.step()``,
  of an optimizer in the state or not, the step waits until this rank's chunks of that optimizer's
  tensors (parameters, state, tensor hyper-parameters) are copied. Parameters change only in a step,
  so no step runs ahead of the copies, including the steps that move no version counter (``fused=True``,
  a custom step writing through ``.data``). The optimizers of the state are known at the call and their
  chunks copied first; another one is matched by storage at its first step, and its chunks copied next.
  The wait is bounded by the save's work deadline; past it the step goes on and the save fails with
  :class:`TornSnapshotError` (the step may have changed what was not copied, leaving no trace).

On the save's thread (:meth:`BackgroundStaging.plan`, then :meth:`BackgroundStaging.run`): the chunks
are copied into the slab in that order, then the rest in file order; CPU sources by single-threaded
pieces read with :func:`~shardsafe.engine.hostmem.read_memory` (with every intra-op thread while a step
waits for them), accelerator sources on the device's side stream. Before any byte of a tensor is read
(its copy, each piece, the incremental comparison, the per-rank digests), and once its copy landed,
its memory is checked against the call's record: a tensor freed or replaced since
(``untyped_storage().resize_(0)``, ``set_``, ``resize_``, ``.data =``) fails the save instead of crashing
the process. After each copy, its version and first bytes are compared with the
call's; a change fails the save on every rank with :class:`TornSnapshotError` naming the tensor (through
the commit round), nothing is committed, and the previous checkpoint at the path stays loadable. Chunks
an incremental save refers to instead of writing are checked once compared
(:meth:`BackgroundStaging.check_unchanged`).

What it cannot see (docs/async.md): outside an optimizer step, a write that moves no version counter
and leaves the tensor's first bytes as they were (or any such write to an accelerator tensor), an
operation on another thread still running when the tensor's copy ends (the counter moves when the
operation ends), and a storage freed under a copy that cannot guard its read (another thread's, while
a step waits; or where ``process_vm_readv`` is refused).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shardsafe.deadline import Deadline
from shardsafe.engine import hostmem, sources, staging, stepgate
from shardsafe.engine.plan import PendingChunk
from shardsafe.engine.sources import Record, StorageKey
from shardsafe.errors import TornSnapshotError
from shardsafe.state.flatten import FlatState, TensorItem

logger = logging.getLogger(__name__)


@dataclass
class _Guard:
    """One optimizer in one save: the chunks its next step writes, and whether they are copied."""

    name: str
    optimizer: torch.optim.Optimizer
    keys: set[StorageKey] | None = None  # the storages of its tensors, once matched
    pending: set[int] = field(default_factory=set)  # this rank's chunks of its tensors not yet copied
    ready: threading.Event = field(default_factory=threading.Event)


def _torn(path: str, rank: int, name: str, what: str, fix: str) -> TornSnapshotError:
    return TornSnapshotError(
        f"async_save of {path!r} (staging='background'): tensor {name!r} {what} on rank {rank} after the call and "
        f"before it was copied; nothing was committed and the previous checkpoint at the path is untouched. {fix}"
    )


class BackgroundStaging:
    """The background staging of one rank's share of one save; see the module docstring.

    Made at the call from the flattened state (:meth:`__init__`: tensors recorded, module buffers
    cloned into the state's items), then :meth:`attach` arms the step gate before the call returns.
    On the save's thread, once the chunks are planned: :meth:`check_memory` before the state's tensors
    are read (digests, incremental comparison), :meth:`plan` (the copy order; also called at the call
    where the plan is made there), :meth:`check_unchanged` for chunks the save refers to instead of
    copying, :meth:`run` with the :class:`Staged` of :attr:`chunks`. :meth:`close` in every case
    (idempotent; :meth:`run` calls it). :attr:`done` is set once staging has ended, copied or failed."""

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
        self.waited = 0.0  # seconds optimizer steps spent waiting for this staging
        self._waiting = 0  # optimizer steps waiting now: the CPU copies then take every core
        buffer_keys = {sources.storage_key(b) for b in buffers}
        buffer_keys.discard(None)
        # id(item.local) -> the item's tensors as the call found them (the items stay referenced by
        # ``flat`` until the plan, and the per-rank items made from them share their ``local``)
        self._recorded: dict[int, list[Record]] = {}
        self._recorded_by_name: dict[str, list[Record]] = {}  # by tensor name, once planned
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
        # id(optimizer) -> its guard: those of the state now (copied first), others at their first step
        self.guards: dict[int, _Guard] = {id(opt): _Guard(name, opt) for name, opt in sources.optimizers_of(state)}
        self._unrelated: dict[int, torch.optim.Optimizer] = {}  # stepped, touching none of this save's tensors
        self._source_keys: set[StorageKey] | None = None  # the storages of the recorded tensors, once asked
        self.chunks: list[PendingChunk] = []
        self.sources: list[list[Record]] = []  # per chunk, until its copy is checked
        self.order: list[int] = []
        self._chunk_keys: list[StorageKey | None] = []
        self._expect: list[int] = []  # per chunk: its data pointer at the call (0: unknown)
        self._heads: list[tuple[int, int]] = []  # per chunk: the first bytes its copy must start with (width 0: none)
        self._starts: list[int] = []  # per chunk: where its copy lands in the slab
        self._staged: staging.Staged | None = None
        self._planned = False
        self._copied: set[int] = set()
        self._urgent: collections.deque[int] = collections.deque()  # chunks a waiting step needs, copied next
        self._breach = ""  # why a step may have run ahead of the copies (it gave up waiting; the gate failed)
        self._lock = threading.Lock()
        self._closed = False
        self.deadline: Deadline | None = None

    def _capture(
        self, item: TensorItem, buffers: set[StorageKey | None], devices: dict[tuple[str, int], torch.device]
    ) -> None:
        """(the call) Record ``item``'s tensors; clone those without a version (inference tensors) or
        that are a module's buffers, in place of the originals in ``item``; note the accelerators they
        are on in ``devices``."""
        if item.pieces is None and not buffers:  # one box, no buffer to clone: the common case
            t = item.local
            version = sources.version_of(t)
            if version is not None and not t.is_cuda:
                self._recorded[id(t)] = [sources.record(t, version)]
                self._names[id(t)] = item.name
                return
        recorded: list[Record] = []
        boxes = item.boxes()
        cloned = False
        for n, (offsets, t) in enumerate(boxes):
            if t.is_cuda:
                devices.setdefault(hostmem.device_key(t.device), t.device)
            version = sources.version_of(t)
            if version is None or (buffers and sources.storage_key(t) in buffers):
                copy = t.detach().clone()  # on its own device and stream
                self.cloned += copy.nbytes
                boxes[n] = (offsets, copy)
                cloned = True
            else:
                recorded.append(sources.record(t, version))
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
        ``local``): recorded, or a copy of it made and kept in :attr:`substitutes`."""
        if t.is_cuda:
            devices.setdefault(hostmem.device_key(t.device), t.device)
        version = sources.version_of(t)
        if version is None or (buffers and sources.storage_key(t) in buffers):
            copy = t.detach().clone()
            self.cloned += copy.nbytes
            self.substitutes[id(t)] = copy
            self._recorded[id(copy)] = []
        else:
            self._recorded[id(t)] = [sources.record(t, version)]

    # ------------------------------------------------------------------ the save's thread, before copying

    def check_memory(self, flat: FlatState) -> None:
        """(the save's thread, before it reads the tensors of ``flat``, the state as the call captured it:
        per-rank digests, incremental comparison, the plan) Raise :class:`TornSnapshotError` for a tensor
        whose memory was freed or replaced since the call (reading it would crash the process, or read
        another tensor's bytes)."""
        for item in (*flat.items, *flat.per_rank):
            for t, _, ptr, *_ in self._recorded.get(id(item.local), []):
                if ptr and not sources.same_memory(t, ptr):
                    raise self._moved(self._names.get(id(item.local), item.name))

    def plan(self, flat: FlatState, chunks: Sequence[PendingChunk]) -> None:
        """(the save's thread; the call's where the save plans there) This rank's planned ``chunks`` of
        ``flat`` (made from the items :meth:`__init__` captured) become :attr:`chunks`: those the
        optimizers' next steps touch first (the state's optimizers, in their order), then the rest. An
        optimizer with nothing to copy on this rank is released at once."""
        self.check_memory(flat)
        items = (*flat.items, *flat.per_rank)
        recorded = {i.name: self._recorded.get(id(i.local), []) for i in items}
        self._called = {i.name: self._names.get(id(i.local), i.name) for i in items}
        self.chunks = list(chunks)
        self.sources = [recorded.get(c.name, []) for c in self.chunks]
        self._expect, self._heads, self._starts, pos = [], [], [], 0
        for c, src in zip(self.chunks, self.sources, strict=True):
            expect, width, head = sources.expected(c.data, src)
            self._expect.append(expect)
            self._heads.append((width, head))
            self._starts.append(pos)
            pos += c.nbytes
        keys = [sources.storage_key(c.data) if src else None for c, src in zip(self.chunks, self.sources, strict=True)]
        with self._lock:
            known = list(self.guards.values())
        owned = {id(g): g.keys if g.keys is not None else sources.optimizer_keys(g.optimizer) for g in known}
        with self._lock:
            self._chunk_keys = keys
            first: list[int] = []
            taken: set[int] = set()
            for g in self.guards.values():  # the state's first, then those that stepped already
                g.keys = owned.get(id(g), g.keys)
                assert g.keys is not None
                g.pending = {i for i, k in enumerate(keys) if k is not None and k in g.keys}
                first += sorted(g.pending - taken)
                taken |= g.pending
                if not g.pending:
                    g.ready.set()
            self.order = first + [i for i in range(len(self.chunks)) if i not in taken]
            self._planned = True
        self._recorded_by_name = recorded

    def check_unchanged(self, names: Sequence[str]) -> None:
        """(the save's thread, after the plan) The tensors ``names`` are not copied (the save refers to a
        base's equal chunks, compared after the call): raise :class:`TornSnapshotError` if one changed
        since the call."""
        for name in names:
            for t, version, ptr, width, head in self._recorded_by_name.get(name, []):
                self._check(name, t, version)
                if ptr and not sources.same_memory(t, ptr):
                    raise self._moved(self._called.get(name, name))
                if width and sources.first_bytes(ptr, width) != head:
                    raise self._written(self._called.get(name, name))

    # ------------------------------------------------------------------ the step gate

    def attach(self, deadline: Deadline) -> None:
        """(the caller's thread, before ``async_save`` returns) Arm the step gate: every optimizer's next
        step waits for this rank's chunks of its tensors, until ``deadline`` at most."""
        self.deadline = deadline
        stepgate.arm(self)

    def before_step(self, opt: torch.optim.Optimizer) -> None:
        """(the thread calling ``opt.step()``, from :mod:`~shardsafe.engine.stepgate`) Wait until this
        rank's chunks of ``opt``'s tensors are copied (at once if it has none), until the deadline."""
        if self.done.is_set():
            return
        try:
            g = self._guard(opt)
        except Exception as err:  # the save fails, not the training step: it cannot know what the step writes
            logger.exception("shardsafe: rank %d: the step gate of %s failed", self.rank, self.path)
            with self._lock:
                self._breach = self._breach or (
                    f"the step gate could not match an optimizer ({type(opt).__name__}) to the save's tensors "
                    f"({err!r}), so its step may have run ahead of their copies"
                )
            return
        if g is None or g.ready.is_set():
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
                if not ok and not g.ready.is_set():
                    self._breach = self._breach or (
                        f"optimizer {g.name!r} stepped before its tensors were copied (its step waited until the "
                        "save's deadline)"
                    )
        if not ok:
            logger.warning(
                "shardsafe: rank %d: optimizer %r stepped before the background staging of %s copied its tensors "
                "(waited until the save's deadline); the save fails with TornSnapshotError",
                self.rank,
                g.name,
                self.path,
            )

    def _guard(self, opt: torch.optim.Optimizer) -> _Guard | None:
        """``opt``'s guard in this save; ``None`` if its tensors are none of this save's. An optimizer seen
        for the first time is matched by storage: at its first step, once per save."""
        key = id(opt)
        with self._lock:
            if self._closed or key in self._unrelated:
                return None
            g = self.guards.get(key)
            if g is not None:
                return g
        keys = sources.optimizer_keys(opt)  # on the stepping thread, outside the lock
        with self._lock:
            if self._closed:
                return None
            if not self._planned:
                if self._source_keys is None:
                    recorded = [r[0] for rs in self._recorded.values() for r in rs]
                    self._source_keys = {k for k in map(sources.storage_key, recorded) if k is not None}
                if not keys & self._source_keys:
                    self._unrelated[key] = opt
                    return None
            g = self.guards[key] = _Guard(f"{type(opt).__name__} outside the state", opt, keys)
            if self._planned:
                g.pending = {i for i, k in enumerate(self._chunk_keys) if k in keys and i not in self._copied}
                self._urgent.extend(sorted(g.pending))
                if not g.pending:
                    g.ready.set()
            return g

    # ------------------------------------------------------------------ the copies

    def run(self, staged: staging.Staged, fault: Callable[[], None]) -> None:
        """(the save's background thread) Copy every chunk into ``staged``'s slab in :attr:`order` (the
        chunks a waiting step needs first), checking each one's memory before and its version and first
        bytes after its copy; raise :class:`TornSnapshotError` for the first that changed. Disarms the
        gate however it ends."""
        try:
            fault()
            self._staged = staged
            staging.fill(staged, self._sequence(), self._landed, lambda: self._waiting == 0, self._readable)
            with self._lock:
                if self._breach:
                    raise self._stepped()
        finally:
            self.close()

    def _sequence(self) -> Iterator[int]:
        """The chunks in the order they are copied: those a waiting step needs, else the plan's next."""
        planned = iter(self.order)
        taken: set[int] = set()
        while True:
            i = None
            with self._lock:
                while self._urgent and i is None:
                    j = self._urgent.popleft()
                    i = j if j not in taken else None
            if i is None:
                i = next((j for j in planned if j not in taken), None)
                if i is None:
                    return
            taken.add(i)
            yield i

    def _readable(self, i: int) -> None:
        """(before chunk ``i``'s memory is read) Its memory is the one the call recorded."""
        expect = self._expect[i]
        if expect and not sources.same_memory(self.chunks[i].data, expect):
            raise self._moved(self._called.get(self.chunks[i].name, self.chunks[i].name))

    def _landed(self, i: int) -> None:
        with self._lock:
            if self._breach:  # a step ran ahead of the copies: what it wrote may have left no trace
                raise self._stepped()
        self._readable(i)  # freed under the copy (an accelerator's, or a heap block the CPU read): not its bytes
        c = self.chunks[i]
        records, self.sources[i] = self.sources[i], []
        for t, version, *_ in records:
            self._check(c.name, t, version)
        width, head = self._heads[i]
        slab = self._staged.slab if self._staged is not None else None
        if width and slab is not None and sources.first_bytes(slab.tensor.data_ptr() + self._starts[i], width) != head:
            raise self._written(self._called.get(c.name, c.name))
        with self._lock:
            self._copied.add(i)
            for g in self.guards.values():
                if i in g.pending:
                    g.pending.discard(i)
                    if not g.pending:
                        g.ready.set()

    def _check(self, name: str, src: torch.Tensor, before: int) -> None:
        if int(src._version) != before:
            raise _torn(
                self.path,
                self.rank,
                self._called.get(name, name),
                f"was changed in place (version {before} -> {int(src._version)})",
                "Change it only after handle.wait_staged(), or save with staging='blocking'",
            )

    def _moved(self, name: str) -> TornSnapshotError:
        return _torn(
            self.path,
            self.rank,
            name,
            "lost or replaced its memory (untyped_storage().resize_, set_, resize_, .data = ...)",
            "Free or replace it only after handle.wait_staged(), or save with staging='blocking'",
        )

    def _written(self, name: str) -> TornSnapshotError:
        return _torn(
            self.path,
            self.rank,
            name,
            "was written by an operation that moves no version counter (through .data, a numpy view, a "
            "BatchNorm forward on statistics held outside their module)",
            "Change it only after handle.wait_staged(), or save with staging='blocking'",
        )

    def _stepped(self) -> TornSnapshotError:
        return TornSnapshotError(
            f"async_save of {self.path!r} (staging='background'): on rank {self.rank}, {self._breach}; nothing was "
            "committed and the previous checkpoint at the path is untouched. Give the save a longer timeout, or "
            "save with staging='blocking'"
        )

    def close(self) -> None:
        """(any thread, idempotent) Staging is over: disarm the gate, release waiting steps."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            guards = list(self.guards.values())
        stepgate.disarm(self)
        for g in guards:
            g.ready.set()
        with self._lock:
            self.guards = {}
            self._unrelated = {}
            self._source_keys = None
            self.sources = []
            self._recorded = {}
            self._recorded_by_name = {}
            self._names = {}
            self.chunks = []  # the save keeps the staged copies; no reference to the caller's tensors
            self._staged = None
        self.done.set()
