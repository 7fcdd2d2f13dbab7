"""Background staging (``async_save(..., staging="background")``): the call returns before copying any
tensor, and the checkpoint still holds the values at the call, or the save fails; it is never torn.

At the call (:class:`BackgroundStaging`, the caller's thread), after the plan:

- **module buffers are cloned** on their own device (BatchNorm running statistics and the like). They
  are small (a few KiB per layer, well under 1% of a model), a forward changes them, and the kernels
  that change them (``native_batch_norm``) do not move their version counter, so they could neither be
  waited for cheaply (a forward pre-hook would hold up every forward of the model for its whole
  staging) nor checked: copying them at once is the one choice both cheap and exact;
- **every other chunk's version counter** (``tensor._version``, shared by views and ``detach()``) is
  recorded;
- **optimizers found in the state are gated**: their next ``optimizer.step()`` waits until the chunks
  of their parameters and state are copied; a parameter is immutable until the step, so the step that
  follows the call never runs ahead of the copy. The wait is bounded by the save's work deadline; past
  it the step goes on, and the version check below fails the save rather than tear it. The gate is
  disarmed when staging ends, however it ends. It is one step pre-hook per optimizer
  (``register_step_pre_hook``), installed by the first background save of that optimizer and left
  registered, disarmed, afterwards (it then returns at once): removing a hook from the staging thread
  while the training thread's ``step()`` iterates the optimizer's hooks raises "OrderedDict mutated
  during iteration" in the training step, so no hook is ever removed from another thread.

On the save's background thread (:meth:`BackgroundStaging.run`), before the write: the chunks are
copied into the slab, those the next optimizer step touches first (parameters and state of the
optimizers, in their order), then the rest in file order; CPU sources by single-threaded ``memmove``
pieces (with every intra-op thread while an optimizer step waits for them), accelerator sources on
the device's side stream (created at CUDA's lowest priority, the default), each ordered after the
work queued on the current stream at the call. After each chunk's copy has landed, its version
counter is compared with the one at the call: a change means the tensor was written in place in
between, and the save fails on every rank with :class:`TornSnapshotError` naming the tensor (through
the commit round, as any failure of a rank), nothing is committed and the previous checkpoint at the
path stays loadable.

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
from shardsafe.engine import staging
from shardsafe.engine.plan import PendingChunk
from shardsafe.errors import TornSnapshotError
from shardsafe.format.values import PerRank
from shardsafe.state.flatten import Filtered, modules_of

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
    pending: set[int]
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
    """The background staging of one rank's chunks of one save; see the module docstring.

    ``chunks``: this rank's planned chunks (the caller's tensors); :attr:`chunks` are those to stage
    (module buffers replaced by their clones), to hand to :func:`staging.stage` with ``defer``. Call
    :meth:`attach` before returning to the caller, :meth:`run` with that :class:`Staged` on the save's
    thread, :meth:`close` in every case (idempotent; :meth:`run` calls it). :attr:`done` is set once
    staging has ended, copied or failed."""

    def __init__(self, chunks: Sequence[PendingChunk], state: Mapping[str, Any], *, path: str, rank: int) -> None:
        self.path = path
        self.rank = rank
        self.done = threading.Event()
        self.cloned = 0  # bytes copied at the call (module buffers)
        self.waited = 0.0  # seconds optimizer steps spent waiting for this staging (all gates)
        self._waiting = 0  # optimizer steps waiting now: the CPU copies then take every core
        buffers: set[StorageKey | None] = set()
        for _, module in modules_of(state):
            buffers.update(_storage_key(b) for b in module.buffers())
        buffers.discard(None)
        self.chunks: list[PendingChunk] = []
        self.versions: list[int | None] = []
        self.sources: list[torch.Tensor | None] = []  # what each version belongs to, until checked
        for c in chunks:
            version = _version(c.data)
            if version is None or (buffers and _storage_key(c.data) in buffers):
                c = PendingChunk(c.name, c.offsets, c.sizes, c.data.detach().clone())  # on its own device and stream
                self.cloned += c.nbytes
                version = None  # nobody else holds the clone
            self.chunks.append(c)
            self.versions.append(version)
            self.sources.append(c.data if version is not None else None)
        keys = [
            _storage_key(c.data) if v is not None else None for c, v in zip(self.chunks, self.versions, strict=True)
        ]
        self.guards: list[_Guard] = []
        for name, opt in _optimizers(state):
            owned = _optimizer_keys(opt)
            mine = {i for i, k in enumerate(keys) if k is not None and k in owned}
            self.guards.append(_Guard(name, opt, mine))
        first: list[int] = []
        taken: set[int] = set()
        for g in self.guards:
            first += sorted(g.pending - taken)
            taken |= g.pending
        self.order = first + [i for i in range(len(self.chunks)) if i not in taken]
        self._lock = threading.Lock()
        self._closed = False
        self.deadline: Deadline | None = None

    def attach(self, deadline: Deadline) -> None:
        """(the caller's thread, before ``async_save`` returns) Arm the gates of the optimizers whose
        chunks this rank copies: their next step waits for those chunks, until ``deadline`` at most."""
        self.deadline = deadline
        for g in self.guards:
            if g.pending:
                g.wait = self._waiter(g)
                gate_of(g.optimizer).arm(g.wait)
            else:
                g.ready.set()

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
        src, before = self.sources[i], self.versions[i]
        self.sources[i] = None
        if src is not None and before is not None and int(src._version) != before:
            name = self.chunks[i].name
            raise TornSnapshotError(
                f"async_save of {self.path!r} (staging='background'): tensor {name!r} was changed in place on "
                f"rank {self.rank} after the call and before it was copied (version {before} -> {int(src._version)}); "
                "nothing was committed and the previous checkpoint at the path is untouched. Put the optimizer that "
                "changes it in the state (its step then waits for the copy), change it only after "
                "handle.wait_staged(), or save with staging='blocking'"
            )
        for g in self.guards:
            if i in g.pending:
                g.pending.discard(i)
                if not g.pending:
                    self._release(g)

    def close(self) -> None:
        """(any thread, idempotent) Staging is over: disarm the gates, release waiting steps."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for g in self.guards:
            self._release(g)
        self.sources = [None] * len(self.sources)
        self.chunks = []  # the save keeps the staged copies; no reference to the caller's tensors
        self.done.set()
