"""Reading tensors out of a checkpoint: only the byte ranges a destination box needs, verified block
by block in a bounce buffer, then copied straight into the destination when it takes the saved bytes
as they are (contiguous, the saved dtype, whole rows; on CPU, or on CUDA through page-locked buffers).

A destination is a tensor (this rank's local data) and its global offsets; it may cut across the
saved chunks in any way (resharding between any world sizes).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, wait
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass
from typing import Any

import torch

from shardsafe import knobs
from shardsafe.catalog.not_found import not_found
from shardsafe.catalog.refs import check_refs, chunk_path, missing_base
from shardsafe.deadline import Deadline
from shardsafe.engine import hostmem
from shardsafe.engine.memory import available_memory
from shardsafe.errors import (
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    CorruptCheckpointError,
    InsufficientMemoryError,
)
from shardsafe.format.datafile import digest, read_blocks, tensor_bytes
from shardsafe.format.index import read_index
from shardsafe.format.manifest import Chunk, Manifest, TensorEntry, parse_manifest
from shardsafe.format.resolve import ChunkSource, expand
from shardsafe.format.sharding import Region
from shardsafe.storage import MANIFEST_NAME, Storage
from shardsafe.workers import Pool

logger = logging.getLogger(__name__)


def open_manifest(storage: Storage, path: str) -> Manifest:
    """(any rank) The validated manifest of the committed checkpoint at ``path``, as written: a ruled
    tensor's (format v3) chunks are not listed (:func:`chunk_source` finds those a reader needs). Reads
    at most ``SHARDSAFE_MAX_MANIFEST_BYTES`` of a regular file; raises only checkpoint errors
    (:class:`CheckpointNotFoundError`, :class:`CorruptCheckpointError`)."""
    where = storage.join(path, MANIFEST_NAME)
    try:
        raw = storage.read_bytes(where)
    except FileNotFoundError:
        raise not_found(storage, path) from None
    except IsADirectoryError:
        raise CorruptCheckpointError(f"{where} is a directory, not a manifest") from None
    except NotADirectoryError:
        raise CheckpointNotFoundError(
            f"{path} is a file, not a checkpoint directory; check the path (a torch.save file is brought in with "
            f"`shardsafe import {path} DEST`)"
        ) from None
    manifest = parse_manifest(raw, where)
    check_refs(path, manifest)
    return manifest


def chunk_source(storage: Storage, path: str, manifest: Manifest) -> ChunkSource:
    """(a reader) The chunks of the checkpoint at ``path`` on demand: a ruled tensor's (format v3) from
    the indexes of the data files that hold them, each read and checked once
    (:class:`~shardsafe.format.resolve.ChunkSource`)."""

    def index(file: str) -> Any:
        return read_index(storage, storage.join(path, file), manifest.files[file])

    return ChunkSource(manifest, index, storage.join(path, MANIFEST_NAME))


def read_manifest(storage: Storage, path: str) -> Manifest:
    """(a whole-checkpoint reader: export, conversion) The validated manifest of the committed
    checkpoint at ``path`` with every chunk listed: a ruled tensor's (format v3) from the indexes of
    every data file that holds some, each read and checked. A reader of a part (a load) uses
    :func:`open_manifest` and reads only the indexes it needs."""
    manifest = open_manifest(storage, path)
    if not any(t.sharding is not None for t in manifest.tensors.values()):
        return manifest
    return expand(chunk_source(storage, path, manifest))


def check_sizes(
    storage: Storage,
    path: str,
    manifest: Manifest,
    tensors: Sequence[str],
    source: ChunkSource | None = None,
    regions: Mapping[str, Sequence[Region] | None] | None = None,
) -> None:
    """Before allocating ``tensors`` from manifest shapes: their data files must really be as large as
    the manifest says (and regular files), so a forged shape cannot make a reader allocate memory the
    files do not back. A ruled tensor (format v3): the files holding its chunks that meet its
    ``regions`` (all of them when it has none), whose indexes ``source`` reads and checks (sizes,
    header and index checksums) to find them."""
    ruled = [t for t in tensors if manifest.tensors[t].sharding is not None]
    if ruled:
        source = source if source is not None else chunk_source(storage, path, manifest)
        for t in ruled:
            wanted = None if regions is None else regions.get(t)
            for region in [None] if wanted is None else wanted:
                source.chunks(t, region)
    files = {(c.ref or "", c.file): c for t in tensors for c in manifest.tensors[t].chunks}
    for (ref, name), chunk in sorted(files.items()):
        file = chunk_path(storage, path, chunk)
        want = manifest.file_entry(chunk).size
        try:
            size = storage.size(file)
        except FileNotFoundError:
            if ref:
                raise missing_base(path, manifest, ref, name, file) from None
            raise CorruptCheckpointError(f"{file}: data file missing") from None
        if size != want:
            base = f" (of the base checkpoint {ref!r}, replaced or altered since)" if ref else ""
            raise CorruptCheckpointError(f"{file}: {size} bytes, the manifest says {want}{base} (truncated or altered)")
        if ref:  # another checkpoint's file: its header must be the one this manifest refers to
            entry = manifest.file_entry(chunk)
            head = bytearray(entry.header_bytes)
            storage.read_into(file, 0, memoryview(head))
            if digest(head) != entry.header_checksum:
                raise CorruptCheckpointError(
                    f"{file}: its header checksum differs from the one {path} refers to: the base checkpoint "
                    f"{ref!r} was replaced or altered. Load an older checkpoint."
                )


def check_allocation(
    storage: Storage,
    path: str,
    manifest: Manifest,
    tensors: Sequence[str] | Mapping[str, int],
    source: ChunkSource | None = None,
    regions: Mapping[str, Sequence[Region] | None] | None = None,
) -> None:
    """(the process about to allocate) Before allocating ``tensors`` fresh: the files back them
    (:func:`check_sizes`) and their bytes fit in the memory available to this process (a sparse file
    makes a forged shape look backed). ``tensors`` maps each name to the bytes its new tensor takes (a
    local shard of it), or lists names allocated whole from their manifest shapes. Raises
    :class:`CheckpointError` naming the largest tensor, before any allocation."""
    sizes = dict(tensors) if isinstance(tensors, Mapping) else {t: manifest.tensors[t].nbytes for t in tensors}
    check_sizes(storage, path, manifest, list(sizes), source, regions)
    need = sum(sizes.values())
    have = available_memory()
    if sizes and need > have:
        largest = max(sizes, key=lambda t: sizes[t])
        raise InsufficientMemoryError(
            f"load of {path!r}: its tensors need {need} bytes of memory (the largest, {largest!r}, "
            f"{sizes[largest]}), but only {have} are available to this process. Load into a "
            "state whose tensors already exist (filled in place), or on a machine with more memory."
        )


@dataclass
class Task:
    """Copy the part of ``chunk`` that overlaps the destination into ``dest``."""

    name: str
    chunk: Chunk
    dest: torch.Tensor  # the destination region (a view), shaped like the overlap
    box_lo: tuple[int, ...]  # overlap, in chunk-local coordinates
    box_hi: tuple[int, ...]


def plan_reads(
    name: str, entry: TensorEntry, dest: torch.Tensor, offsets: Sequence[int], chunks: Sequence[Chunk] | None = None
) -> list[Task]:
    """Tasks that fill ``dest`` (global offsets ``offsets``) from ``chunks`` of ``entry`` (default: the
    chunks it lists; a ruled tensor's come from :meth:`ChunkSource.chunks`)."""
    tasks = []
    for c in entry.chunks if chunks is None else chunks:
        lo = [max(co, do) for co, do in zip(c.offsets, offsets, strict=True)]
        hi = [min(co + cs, do + ds) for co, cs, do, ds in zip(c.offsets, c.sizes, offsets, dest.shape, strict=True)]
        if any(h <= low for low, h in zip(lo, hi, strict=True)) and entry.shape:
            continue
        region = dest[tuple(slice(a - d, b - d) for a, b, d in zip(lo, hi, offsets, strict=True))]
        tasks.append(
            Task(
                name,
                c,
                region,
                tuple(a - o for a, o in zip(lo, c.offsets, strict=True)),
                tuple(b - o for b, o in zip(hi, c.offsets, strict=True)),
            )
        )
    return tasks


def run_tasks(
    storage: Storage,
    path: str,
    manifest: Manifest,
    tasks: Sequence[Task],
    on_first: Callable[[], None],
    deadline: Deadline,
    on_bytes: Callable[[int], None] | None = None,
) -> int:
    """(the loading rank, the caller's thread) Execute the reads on a few daemon threads within
    ``deadline``; returns the bytes read. Every block is read into a bounce buffer of the reading thread and
    verified there before it is copied into a destination, so a corrupt block never lands in the
    caller's tensors. For CUDA destinations the bounce buffers are page-locked and the copies run
    asynchronously on a side stream of the destination's device (after the work queued on its current
    stream), overlapped with the next reads; the caller's current stream waits for them.
    ``on_bytes(n)`` (progress) is called from the reader threads as verified bytes are delivered.

    When this returns or raises, no reader thread will touch the caller's tensors again: the threads
    have finished, or (a read hung past the deadline: raises) are fenced off from the destinations and
    end with their reads into their own buffers; every device copy has landed."""
    if not tasks:
        return 0
    threads = max(1, min(knobs.io_threads(), len(tasks)))
    run = _ReadRun(storage, path, manifest, tasks, threads)
    run.on_bytes = on_bytes
    pool = Pool(threads, "read")  # daemon threads: a read hung for good never keeps the process alive
    futures: list[Future[int]] = []
    total = 0
    ok = False
    try:
        futures = [pool.submit(run.batch, b) for b in _batches(tasks, manifest, threads)]
        for i, f in enumerate(futures):
            try:
                total += f.result(timeout=deadline.remaining())
            except FuturesTimeout:
                raise CheckpointTimeoutError(
                    f"load of {path!r}: reads did not finish within {deadline.seconds:g}s (the call's "
                    f"{deadline.budget} deadline; the storage is hung or far too slow); raise timeout= or "
                    "SHARDSAFE_IO_TIMEOUT if it is merely slow"
                ) from None
            if i == 0:
                on_first()
        ok = True
    finally:
        run.finish(futures, pool, deadline, ok)
    return total


_BATCH_BYTES = 1 << 20
"""Small reads go to the reader threads in batches of at most this many bytes: a future and a thread
switch per tensor cost more than reading a small tensor."""


def _batches(tasks: Sequence[Task], manifest: Manifest, threads: int) -> list[list[Task]]:
    """``tasks`` in order, cut into runs of at most about ``_BATCH_BYTES``, and small enough that there
    are about four runs per reader thread (a storage with a long round trip keeps every thread busy); a
    larger task runs alone."""
    sizes = [_task_bytes(manifest, t) for t in tasks]
    cap = max(1, min(_BATCH_BYTES, sum(sizes) // (4 * threads)))
    out: list[list[Task]] = []
    size = 0
    for t, n in zip(tasks, sizes, strict=True):
        if not out or size + n > cap:
            out.append([])
            size = 0
        out[-1].append(t)
        size += n
    return out


class _Cancelled(Exception):
    """A reader thread met the closed fence: the load is over, its copy is refused."""


class _Fence:
    """Copies into the caller's tensors run inside the fence. :meth:`close` refuses every later copy
    and waits for those in progress, so a thread that outlives its load can never write into them."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self.closed = False

    def __enter__(self) -> None:
        with self._cond:
            if self.closed:
                raise _Cancelled()
            self._active += 1

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._active -= 1
            self._cond.notify_all()

    def close(self, deadline: Deadline) -> bool:
        """Close; True once no copy is in progress (a copy is a memcpy or an enqueue: it ends)."""
        with self._cond:
            self.closed = True
            return self._cond.wait_for(lambda: self._active == 0, max(1.0, deadline.remaining()))


class _Bounce:
    """A reading thread's buffer for one block (two halves when page-locked, so a block is read while
    the previous one is still being copied to the device)."""

    def __init__(self, size: int, pinned: bool) -> None:
        self.halves = 2 if pinned else 1
        self.size = size
        self.buf = hostmem.HostBuffer(size * self.halves, pinned=pinned)
        self.events: list[Any] = [None] * self.halves
        self.turn = 0

    def take(self, n: int) -> memoryview:
        self.turn = (self.turn + 1) % self.halves
        self.settle(self.turn)
        return self.buf.memory(self.turn * self.size, self.turn * self.size + n)

    def copied(self, event: Any) -> None:
        """The half just taken is being copied to a device until ``event``."""
        self.events[self.turn] = event

    def settle(self, half: int | None = None) -> None:
        for h in range(self.halves) if half is None else (half,):
            if self.events[h] is not None:
                self.events[h].synchronize()
                self.events[h] = None


class _ReadRun:
    """One :func:`run_tasks` call: the fence, the bounce buffers, the devices' side streams."""

    def __init__(self, storage: Storage, path: str, manifest: Manifest, tasks: Sequence[Task], threads: int) -> None:
        self.storage, self.path, self.manifest = storage, path, manifest
        self.fence = _Fence()
        self.on_bytes: Callable[[int], None] | None = None
        self.streams: dict[torch.device, Any] = {}
        for t in tasks:
            dev = t.dest.device
            if dev.type == "cuda" and dev not in self.streams:
                self.streams[dev] = hostmem.side_stream(dev, "h2d")
                hostmem.after_current(dev, self.streams[dev])  # the destinations may still be in use
        longest = max((t.chunk.end - t.chunk.begin for t in tasks), default=0)
        size = max(1, min(manifest.block_bytes, longest))
        pinned = bool(self.streams)
        self.free: queue.SimpleQueue[_Bounce] = queue.SimpleQueue()
        for _ in range(threads):
            self.free.put(_Bounce(size, pinned))

    def batch(self, tasks: Sequence[Task]) -> int:
        """(a reader thread) Run ``tasks`` in order with this thread's bounce buffer; the bytes read."""
        bounce = self.free.get_nowait()  # one per thread
        total = 0
        try:
            for t in tasks:
                total += _read_task(self, t, bounce)
            return total
        except _Cancelled:
            return total
        finally:
            bounce.settle()
            self.free.put(bounce)

    def finish(self, futures: Sequence[Future[int]], pool: Pool, deadline: Deadline, ok: bool) -> None:
        """Close the fence, stop what has not started, wait (until the deadline) for the threads, then
        for every device copy; on success order the callers' streams after those copies."""
        drained = self.fence.close(deadline)
        for f in futures:
            f.cancel()
        _, running = wait(futures, timeout=deadline.remaining())
        pool.shutdown(wait=not running)
        if running:
            logger.warning(
                "shardsafe: load of %s: %d read(s) still hung at the deadline; their threads can no longer write "
                "into the destination tensors and end with their reads",
                self.path,
                len(running),
            )
        if not drained:
            logger.error("shardsafe: load of %s: a copy into a destination did not end at the deadline", self.path)
        for dev, stream in self.streams.items():
            done = hostmem.record(stream)
            done.synchronize()  # copies already enqueued: they land before load returns or raises
            if ok:
                hostmem.current_waits_for(dev, stream)


def _read_task(run: _ReadRun, t: Task, bounce: _Bounce) -> int:
    """(a reader thread) Fill ``t.dest`` from its chunk; returns the bytes read."""
    c = t.chunk
    file = chunk_path(run.storage, run.path, c)
    dtype = run.manifest.tensors[t.name].dtype
    if not c.sizes:  # a 0-d tensor
        tmp = torch.empty((), dtype=dtype)
        _read(run, file, c, 0, dtype.itemsize, t.name, bounce, _into(tensor_bytes(tmp), 0))
        _copy_into(run, t.dest, tmp)
        return dtype.itemsize
    row = math.prod(c.sizes[1:]) * dtype.itemsize
    full_rows = t.box_lo[1:] == (0,) * (len(c.sizes) - 1) and t.box_hi[1:] == tuple(c.sizes[1:])
    start, stop = t.box_lo[0] * row, t.box_hi[0] * row
    dest = t.dest
    if full_rows and dest.dtype == dtype and dest.is_contiguous() and dest.device.type in ("cpu", "cuda"):
        dest_bytes = dest.detach().reshape(-1).view(torch.uint8)
        if dest.device.type == "cpu":

            def deliver(off: int, data: memoryview) -> None:
                src = torch.frombuffer(data, dtype=torch.uint8)  # the bounce buffer, no copy
                with run.fence:
                    dest_bytes[off - start : off - start + len(data)].copy_(src)  # without the GIL

        else:
            stream = run.streams[dest.device]

            def deliver(off: int, data: memoryview) -> None:
                src = torch.frombuffer(data, dtype=torch.uint8)  # the page-locked bounce half, no copy
                with run.fence, torch.cuda.stream(stream):
                    dest_bytes[off - start : off - start + len(data)].copy_(src, non_blocking=True)
                    bounce.copied(hostmem.record(stream))

        _read(run, file, c, start, stop, t.name, bounce, deliver)
        return stop - start
    # a column range, another dtype, a strided or non-CPU/CUDA destination: verified rows, then copy_
    rows = torch.empty((t.box_hi[0] - t.box_lo[0], *c.sizes[1:]), dtype=dtype)
    _read(run, file, c, start, stop, t.name, bounce, _into(tensor_bytes(rows), start))
    _copy_into(run, dest, rows[(slice(None), *(slice(a, b) for a, b in zip(t.box_lo[1:], t.box_hi[1:], strict=True)))])
    return stop - start


def _copy_into(run: _ReadRun, dest: torch.Tensor, src: torch.Tensor) -> None:
    """Verified bytes in a private CPU tensor into the caller's ``dest`` (any layout, dtype or device),
    inside the fence; a CUDA copy runs on the side stream and has landed when this returns."""
    with run.fence:
        if dest.device.type == "cuda":
            stream = run.streams[dest.device]
            with torch.cuda.stream(stream):
                dest.copy_(src)
            hostmem.record(stream).synchronize()  # ``src`` is freed on return
        else:
            dest.copy_(src)


def _into(out: memoryview, start: int) -> Callable[[int, memoryview], None]:
    """Deliver verified bytes into a private buffer (no fence: the caller's tensors are not touched)."""

    def deliver(off: int, data: memoryview) -> None:
        out[off - start : off - start + len(data)] = data

    return deliver


def _read(
    run: _ReadRun,
    file: str,
    c: Chunk,
    start: int,
    stop: int,
    name: str,
    bounce: _Bounce,
    deliver: Callable[[int, memoryview], None],
) -> None:
    count = run.on_bytes
    if count is not None:
        inner = deliver

        def deliver(off: int, data: memoryview) -> None:
            inner(off, data)
            count(len(data))

    try:
        read_blocks(
            run.storage,
            file,
            c,
            run.manifest.block_bytes,
            start,
            stop,
            name,
            bounce.take,
            deliver,
            lambda: run.fence.closed,
        )
    except (EOFError, FileNotFoundError) as err:
        raise CorruptCheckpointError(f"{file}: cannot read tensor {name!r}: {err}") from err


def load_bytes(manifest: Manifest, tasks: Sequence[Task]) -> int:
    """(a loading rank) The bytes ``tasks`` deliver (what :func:`~shardsafe.engine.read.run_tasks`
    returns): whole rows of each overlap, the item of a 0-d tensor."""
    return sum(_task_bytes(manifest, t) for t in tasks)


def _task_bytes(manifest: Manifest, t: Task) -> int:
    itemsize = manifest.tensors[t.name].dtype.itemsize
    sizes = t.chunk.sizes
    if not sizes:
        return itemsize
    row = itemsize
    for s in sizes[1:]:
        row *= s
    return (t.box_hi[0] - t.box_lo[0]) * row
