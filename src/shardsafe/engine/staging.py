"""The save pipeline: this rank's chunks (only those it writes) reach the writer as windows of host
memory, in file order. One pipeline serves synchronous and asynchronous saves; they differ only in
where the copies land and when the writer runs.

- A CPU tensor in a synchronous save is written straight from its memory: no copy.
- Any other chunk is copied into host buffers by :func:`copy_piece`; an accelerator source is copied on
  a side stream of its own device, after an event recorded on that device's current stream (the
  producer), and the writer waits for the copy's own event. Nothing synchronises a whole device.

  - Synchronous save: through a bounded pool of reused buffers (one slab of
    ``SHARDSAFE_STAGING_POOL_BYTES``, page-locked for accelerators, carved into slots of
    ``SHARDSAFE_WRITE_PIECE_BYTES``). The copies of the next slots run while the writer hashes and
    writes the current one; a chunk larger than a slot is split across slots, small ones share one.
    Extra host memory: at most the pool, whatever the size of the share.
  - Asynchronous save: into one slab holding exactly this rank's share, laid out as the file's data
    section, filled before ``async_save`` returns (``staging="blocking"``), or after it returned, on
    the save's background thread, in the order :mod:`shardsafe.engine.snapshot` chooses
    (``staging="background"``: :func:`stage` with ``defer``, then :func:`fill`). A finished save
    returns its slab to a list the next save reuses when the share has (nearly) the same size; at
    most ``SHARDSAFE_MAX_INFLIGHT_SAVES`` slabs are kept, so staging memory stays within that many times the share.

``Writer.write`` consumes its argument before returning (every backend copies or writes it), so a
window's memory is reused as soon as the writer asks for the next one.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from shardsafe import knobs
from shardsafe.engine import hostmem
from shardsafe.engine.plan import PendingChunk
from shardsafe.errors import CheckpointTimeoutError, InvalidArgumentError, TornSnapshotError
from shardsafe.format.datafile import tensor_bytes

copy_cpu_sources = False  # tests: send the CPU sources of synchronous saves through the pool too
before_background_copy: Callable[[str], None] | None = None
"""Tests: called on the save's thread (``staging="background"``) before each chunk is copied, with the
chunk's tensor name (to slow staging down, or make it fail, deterministically)."""

_lock = threading.Lock()
_idle: list[hostmem.HostBuffer] = []  # slabs no save holds, reused first
_busy: list[hostmem.HostBuffer] = []  # slabs of asynchronous saves in flight
_pool: hostmem.HostBuffer | None = None  # the synchronous saves' pool, kept for the next save
_pool_lock = threading.Lock()  # one streaming save at a time per process holds the pool


def staged_bytes() -> int:
    """Bytes held by this process's staging memory: slabs (idle and in use) and the pool."""
    with _lock:
        return sum(b.nbytes for b in (*_idle, *_busy)) + (_pool.nbytes if _pool is not None else 0)


def free_idle() -> None:
    """Give back the staging memory no save holds: the synchronous saves' pool and idle slabs (the
    next save that needs them allocates them again)."""
    global _pool
    with _pool_lock:
        if _pool is not None:
            _pool.close()
            _pool = None
    with _lock:
        idle, _idle[:] = list(_idle), []
    for s in idle:
        s.close()


class Staged:
    """This rank's chunks on their way to the writer; see the module docstring. Produced by
    :func:`stage`, consumed by :func:`windows`, released by :meth:`close` (exactly once)."""

    def __init__(self, chunks: Sequence[PendingChunk], *, snapshot: bool, wait: float) -> None:
        self.chunks = list(chunks)
        self.snapshot = snapshot
        self.wait = wait  # seconds to wait for the pool, held by another save of this process
        self.copy = [snapshot or copy_cpu_sources or c.data.device.type != "cpu" for c in self.chunks]
        self.nbytes = sum(c.nbytes for c in self.chunks)
        self.streams: dict[torch.device, Any] = {}  # CUDA device -> side stream, ordered after its producer
        self.slab: hostmem.HostBuffer | None = None
        self._gen: Generator[memoryview, None, None] | None = None

    def pinned(self) -> bool:
        return any(c.data.device.type != "cpu" for c, copy in zip(self.chunks, self.copy, strict=True) if copy)

    def close(self) -> None:
        """(the save, once its data is written or abandoned) Wait for copies in flight, then give the
        pool or the slab back."""
        if self._gen is not None:
            self._gen.close()  # waits for the copies it enqueued and releases the pool
            self._gen = None
        if self.slab is not None:
            _return_slab(self.slab)
            self.slab = None
        self.chunks = []


def stage(
    chunks: Sequence[PendingChunk],
    *,
    snapshot: bool,
    wait: float,
    defer: bool = False,
    marks: Mapping[tuple[str, int], Any] | None = None,
) -> Staged:
    """(every rank, before its tensors may change) Prepare the chunks for the writer. With ``snapshot``
    (asynchronous save) every chunk is copied into one slab before this returns, so the caller may
    change its tensors at once, unless ``defer``: then :func:`fill` copies them later, from another
    thread; otherwise the copies happen while writing. Accelerator copies are ordered after the work
    queued on each source device's current stream: up to this call, or up to the event ``marks`` holds
    for the device (:func:`hostmem.mark_current`, recorded at the save's call when this runs later,
    on the save's thread)."""
    staged = Staged(chunks, snapshot=snapshot, wait=wait)
    for c, copy in zip(staged.chunks, staged.copy, strict=True):
        dev = c.data.device
        if dev.type == "meta":
            raise InvalidArgumentError(
                f"tensor {c.name!r} is on the meta device (it has no data); materialise the model (to_empty and "
                "initialise, or load a checkpoint) before saving it"
            )
        if copy and dev.type == "cuda" and dev not in staged.streams:
            staged.streams[dev] = hostmem.side_stream(dev, "d2h")
            mark = marks.get(hostmem.device_key(dev)) if marks else None
            hostmem.after_current(dev, staged.streams[dev], mark)
    if snapshot and not defer:
        fill(staged)
    return staged


def fill(
    staged: Staged,
    order: Iterable[int] | None = None,
    landed: Callable[[int], None] | None = None,
    gentle: Callable[[], bool] | None = None,
    check: Callable[[int], None] | None = None,
) -> None:
    """Copy every chunk of a snapshot ``staged`` into its slab (laid out in file order). Without
    ``order``: in file order, at full speed (the caller waits). With ``order`` (background staging, the
    caller's training goes on; an iterable, read one index at a time, so the caller may choose the next
    chunk while copying): chunks in that order, and ``landed(i)`` called once chunk ``i``'s bytes
    are in host memory, before the next is copied; what ``landed`` raises stops the staging. A CPU chunk
    is copied by one thread in pieces of ``SHARDSAFE_WRITE_PIECE_BYTES`` (the intra-op
    threads left to the training) while ``gentle()`` says so, else with every intra-op thread (the
    training waits for it). Before any byte of chunk ``i`` is read (and before each piece), ``check(i)``
    may refuse it by raising, then :func:`check_memory` does (a raw copy of freed memory would crash the
    process). The single-threaded pieces, which run beside the training, read through
    :func:`hostmem.read_memory`, so a tensor freed by the training under its copy fails the staging
    instead of the process; the copy with every thread runs while the training waits in a step. (A
    strided CPU chunk is first made contiguous by torch, a read that is not guarded so.)
    On return the chunks hold only metadata, not the caller's tensors; on a failure the staging is
    released."""
    try:
        _fill_slab(staged, order, landed, gentle, check)
    except BaseException:
        staged.close()
        raise
    # the bytes live in the slab now: keep only the chunks' metadata, not the caller's tensors
    staged.chunks = [
        PendingChunk(c.name, c.offsets, c.sizes, torch.empty(c.sizes, dtype=c.data.dtype, device="meta"))
        for c in staged.chunks
    ]


def check_memory(c: PendingChunk) -> None:
    """Raise :class:`InvalidArgumentError` unless the tensor of chunk ``c`` still has the memory of its box:
    the planned sizes, and a storage that holds every byte the tensor reaches. A raw copy of a tensor
    whose storage was freed (``untyped_storage().resize_(0)``, as FSDP-style code does) or shrunk would
    read memory that is not there and crash the process (or save whatever lies at that address)."""
    d = c.data
    if tuple(d.shape) != tuple(c.sizes):
        raise InvalidArgumentError(
            f"tensor {c.name!r}: its shape changed to {tuple(d.shape)} after the save planned {tuple(c.sizes)} "
            "(resize_ or set_ on it); save a tensor while it holds its data"
        )
    if not d.numel() or d.device.type == "meta":
        return
    st = d.untyped_storage()
    end = d.storage_offset() + 1 + sum((s - 1) * t for s, t in zip(d.shape, d.stride(), strict=True))
    if not st.data_ptr() or end * d.element_size() > st.nbytes():
        raise InvalidArgumentError(
            f"tensor {c.name!r} has no memory: it reaches {end * d.element_size()} bytes of a storage of "
            f"{st.nbytes()} bytes (freed: untyped_storage().resize_(0)?); save a tensor while it holds its data "
            "(before freeing it, or after gathering it again)"
        )


def copy_piece(dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
    """Copy the bytes ``src`` (a flat ``uint8`` view of a source) into the host bytes ``dst``: on
    ``stream`` (the source device's side stream) for CUDA, asynchronously; synchronously otherwise."""
    if stream is not None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
    else:
        dst.copy_(src)


def record_done(streams: Sequence[Any]) -> list[Any]:
    """Events marking the copies queued so far on ``streams`` (none for synchronous copies)."""
    return [hostmem.record(s) for s in streams]


def wait_done(events: Sequence[Any]) -> None:
    """Block until the copies behind ``events`` have landed in host memory."""
    for e in events:
        e.synchronize()


def windows(staged: Staged) -> Iterator[memoryview]:
    """(the writing thread) The bytes of ``staged``'s chunks in file order, as windows of host memory
    ready to hash and write. Ask for the next window only once the current one is written."""
    assert staged._gen is None, "windows() is consumed once"
    staged._gen = _windows(staged)
    return staged._gen


# ------------------------------------------------------------------------------------ internals


def _source(staged: Staged, c: PendingChunk, keep: list[torch.Tensor]) -> torch.Tensor:
    """The chunk's bytes as a flat ``uint8`` tensor on its device (a contiguous copy first when the
    chunk is strided: on the side stream for CUDA, kept alive in ``keep`` until its copies land)."""
    data = c.data.detach()
    if not data.is_contiguous():
        stream = staged.streams.get(data.device)
        if stream is not None:
            with torch.cuda.stream(stream):
                data = data.contiguous()
        else:
            data = data.contiguous()
        keep.append(data)
    return data.reshape(-1).view(torch.uint8)


def _cut(data: memoryview, piece: int) -> Iterator[memoryview]:
    for start in range(0, len(data), piece):
        yield data[start : start + piece]


def _fill_slab(
    staged: Staged,
    order: Iterable[int] | None,
    landed: Callable[[int], None] | None,
    gentle: Callable[[], bool] | None,
    check: Callable[[int], None] | None,
) -> None:
    staged.slab = slab = _take_slab(staged.nbytes, staged.pinned())
    keep: list[torch.Tensor] = []
    starts, pos = [], 0
    for c in staged.chunks:
        starts.append(pos)
        pos += c.nbytes
    piece = max(1, knobs.write_piece_bytes())
    try:
        for i in order if order is not None else range(len(staged.chunks)):
            c, pos = staged.chunks[i], starts[i]
            n = c.nbytes
            stream = staged.streams.get(c.data.device)
            if order is not None and before_background_copy is not None:
                before_background_copy(c.name)
            if n:
                if check is not None:
                    check(i)
                check_memory(c)
                made = len(keep)
                src = _source(staged, c, keep)  # holds the source's storage: replacing the tensor's cannot free it
                borrowed = len(keep) == made  # the caller's memory, not a contiguous copy made here
                if gentle is not None and stream is None and src.device.type == "cpu" and gentle():
                    dst, at = slab.view(pos, pos + n).data_ptr(), src.data_ptr()
                    for off in range(0, n, piece):  # the GIL is released: the training thread runs on...
                        if off and borrowed:  # ... and may have freed the memory since the last piece
                            if check is not None:
                                check(i)
                            check_memory(c)
                        if not hostmem.read_memory(dst + off, at + off, min(piece, n - off)):  # ... or under it
                            if check is not None:
                                check(i)
                            check_memory(c)
                            raise TornSnapshotError(f"tensor {c.name!r}: its memory could not be read (EFAULT)")
                else:
                    copy_piece(slab.view(pos, pos + n), src, stream)
                if stream is None:
                    keep.clear()  # a CPU copy is complete when it returns
            if landed is not None:
                if stream is not None:
                    wait_done(record_done([stream]))
                    keep.clear()
                landed(i)
    finally:  # also after a failure: no copy may still be landing in a slab that goes back to the list
        wait_done(record_done(list(staged.streams.values())))
    del keep


def _windows(staged: Staged) -> Generator[memoryview, None, None]:
    piece = max(1, knobs.write_piece_bytes())
    if staged.snapshot:
        assert staged.slab is not None
        yield from _cut(staged.slab.memory(0, staged.nbytes), piece)
        return
    i, n = 0, len(staged.chunks)
    while i < n:
        if not staged.copy[i]:
            check_memory(staged.chunks[i])
            data = staged.chunks[i].data.detach()
            yield from _cut(tensor_bytes(data if data.is_contiguous() else data.contiguous()), piece)
            i += 1
            continue
        j = i
        while j < n and staged.copy[j]:
            j += 1
        yield from _stream(staged, staged.chunks[i:j])
        i = j


def _acquire_pool(staged: Staged) -> hostmem.HostBuffer:
    global _pool
    if not _pool_lock.acquire(timeout=staged.wait):
        raise CheckpointTimeoutError(
            f"save: the staging pool stayed busy for {staged.wait:.0f}s (another synchronous save of this process "
            "holds it); save from one thread at a time, or raise the timeout"
        )
    try:
        size = max(2, knobs.staging_pool_bytes())
        pinned = staged.pinned()
        if _pool is not None and (_pool.nbytes != size or (pinned and not _pool.pinned)):
            _pool.close()
            _pool = None
        if _pool is None:
            _pool = hostmem.HostBuffer(size, pinned=pinned)
        return _pool
    except BaseException:
        _pool_lock.release()
        raise


def _stream(staged: Staged, chunks: Sequence[PendingChunk]) -> Iterator[memoryview]:
    """Chunks that need a copy, through the pool: fill every free slot (the copies run ahead on the
    side streams), hand out the oldest once its copies landed, refill it when the writer is done."""
    pool = _acquire_pool(staged)
    slot = min(max(1, knobs.write_piece_bytes()), pool.nbytes // 2)
    free = collections.deque(range(0, pool.nbytes - slot + 1, slot))
    pending: collections.deque[tuple[int, int, list[Any], list[torch.Tensor]]] = collections.deque()
    k, off = 0, 0  # next byte to copy: chunk k, offset off
    current: torch.Tensor | None = None  # chunk k's bytes
    current_keep: list[torch.Tensor] = []
    try:
        while True:
            while free and k < len(chunks):
                start = free.popleft()
                fill, streams, keep = 0, [], []
                while fill < slot and k < len(chunks):
                    c = chunks[k]
                    if off == c.nbytes:
                        k, off, current, current_keep = k + 1, 0, None, []
                        continue
                    if current is None:
                        check_memory(c)
                        current = _source(staged, c, current_keep)
                    take = min(slot - fill, c.nbytes - off)
                    stream = staged.streams.get(c.data.device)
                    copy_piece(pool.view(start + fill, start + fill + take), current[off : off + take], stream)
                    if stream is not None and stream not in streams:
                        streams.append(stream)
                    keep += [current, *current_keep]
                    fill, off = fill + take, off + take
                if fill:
                    pending.append((start, fill, record_done(streams), keep))
                else:
                    free.append(start)
            if not pending:
                return
            start, fill, events, _keep = pending.popleft()
            wait_done(events)
            yield pool.memory(start, start + fill)
            free.append(start)  # written: the writer consumed the window before asking for the next
    finally:
        for _, _, events, _ in pending:  # abandoned (a write failed): let the copies land first
            wait_done(events)
        pending.clear()
        _pool_lock.release()


def _take_slab(nbytes: int, pinned: bool) -> hostmem.HostBuffer:
    """A slab of at least ``nbytes`` (at most 5% more): an idle one, else a new one (idle slabs that do
    not fit are freed first, so memory stays within the limit of saves in flight)."""

    def fits(s: hostmem.HostBuffer) -> bool:
        return nbytes <= s.nbytes <= nbytes + nbytes // 20 and (s.pinned or not pinned)

    with _lock:
        fit = next((s for s in _idle if fits(s)), None)
        drop = [s for s in _idle if not fits(s)]
        _idle[:] = [s for s in _idle if fits(s) and s is not fit]
        if fit is not None:
            _busy.append(fit)
    for s in drop:
        s.close()
    if fit is None:
        fit = hostmem.HostBuffer(nbytes, pinned=pinned)
        with _lock:
            _busy.append(fit)
    return fit


def _return_slab(slab: hostmem.HostBuffer) -> None:
    with _lock:
        if any(b is slab for b in _busy):
            _busy[:] = [b for b in _busy if b is not slab]
            _idle.append(slab)
        extra = max(0, len(_idle) + len(_busy) - knobs.max_inflight_saves())
        drop, _idle[:] = _idle[:extra], _idle[extra:]
    for s in drop:
        s.close()
