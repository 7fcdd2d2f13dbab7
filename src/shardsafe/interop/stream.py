"""Reading whole tensors out of a checkpoint in bounded pieces, in row-major order, verified.

A tensor is cut into *pieces* of at most one slab (``SHARDSAFE_EXPORT_SLAB_BYTES``): when every chunk
spans the full trailing dimensions (row-sharded FSDP2 parameters, replicated tensors and their row
splits: the usual case), a piece is a run of whole checksum blocks of one chunk, read straight into
the buffer; otherwise it is a range of rows assembled from the chunks that cross it (the load path's
``plan_reads``). Either way every byte is checked against its block checksum before it is used.

A background thread reads the next piece while the caller writes the current one, so two slab
buffers are in use; every read waits at most the io deadline (a hung filesystem raises).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, wait
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass

import torch

from shardsafe import knobs
from shardsafe.catalog.refs import chunk_path
from shardsafe.deadline import Deadline
from shardsafe.engine.guard import mapped_errors
from shardsafe.engine.read import plan_reads, run_tasks
from shardsafe.errors import CheckpointTimeoutError, CorruptCheckpointError
from shardsafe.format.datafile import read_verified, tensor_bytes
from shardsafe.format.manifest import Chunk, Manifest, TensorEntry
from shardsafe.storage import Storage
from shardsafe.workers import Pool


@dataclass(frozen=True)
class Piece:
    """Bytes ``[start, start + nbytes)`` of ``chunk`` (direct), or rows ``[lo, hi)`` of the tensor."""

    name: str  # manifest tensor name
    nbytes: int
    chunk: Chunk | None = None
    start: int = 0
    lo: int = 0
    hi: int = 0


def row_major_chunks(entry: TensorEntry) -> list[Chunk] | None:
    """The chunks in output order when their bytes, back to back, are the tensor in row-major order
    (each spans the full trailing dimensions); ``None`` otherwise."""
    if not entry.shape:
        return None
    if any(c.sizes[1:] != entry.shape[1:] for c in entry.chunks):
        return None
    return sorted((c for c in entry.chunks if c.end > c.begin), key=lambda c: c.offsets[0])


def pieces(manifest: Manifest, name: str, slab: int) -> list[Piece]:
    """How tensor ``name`` is read, in order; each piece holds at most ``slab`` bytes (at least one
    checksum block for a direct piece, at least one row otherwise)."""
    entry = manifest.tensors[name]
    if entry.nbytes == 0:
        return []
    if not entry.shape:
        return [Piece(name, entry.nbytes)]
    direct = row_major_chunks(entry)
    if direct is not None:
        block = manifest.block_bytes
        step = max(1, slab // block) * block  # whole blocks: no block is read twice
        return [
            Piece(name, min(step, c.end - c.begin - s), chunk=c, start=s)
            for c in direct
            for s in range(0, c.end - c.begin, step)
        ]
    row = math.prod(entry.shape[1:]) * entry.dtype.itemsize
    rows = max(1, slab // max(row, 1))
    return [
        Piece(name, (min(lo + rows, entry.shape[0]) - lo) * row, lo=lo, hi=min(lo + rows, entry.shape[0]))
        for lo in range(0, entry.shape[0], rows)
    ]


class PieceReader:
    """Reads pieces of one checkpoint on a background thread, one ahead of the consumer."""

    def __init__(self, storage: Storage, path: str, manifest: Manifest, capacity: int, timeout: float) -> None:
        self.storage, self.path, self.manifest, self.timeout = storage, path, manifest, timeout
        self.buffers = [torch.empty(max(capacity, 8), dtype=torch.uint8) for _ in range(2)]
        self.pool = Pool(1, "export-read")  # daemon threads: a read hung for good never keeps the process alive
        self.io = Pool(knobs.io_threads(), "export-io")

    def close(self) -> None:
        """Stop reading; a read still running (a hung filesystem) is abandoned, not waited for."""
        self.pool.shutdown(wait=False, cancel=True)
        self.io.shutdown(wait=False, cancel=True)

    def stream(self, todo: Sequence[Piece]) -> Iterator[tuple[Piece, torch.Tensor]]:
        """Each piece with its data (a tensor of the saved dtype, valid until the next item is taken)."""
        pending: Future[torch.Tensor] | None = None
        for i, piece in enumerate(todo):
            if pending is None:
                pending = self.pool.submit(self.read, piece, self.buffers[i % 2])
            data = self._result(pending, piece)
            pending = self.pool.submit(self.read, todo[i + 1], self.buffers[(i + 1) % 2]) if i + 1 < len(todo) else None
            yield piece, data

    def _result(self, future: Future[torch.Tensor], piece: Piece) -> torch.Tensor:
        try:
            return future.result(timeout=self.timeout)
        except FuturesTimeout:
            raise CheckpointTimeoutError(
                f"export of {self.path!r}: reading tensor {piece.name!r} did not finish within {self.timeout:.0f}s "
                "(storage hung or far too slow); raise timeout= or SHARDSAFE_IO_TIMEOUT if it is merely slow"
            ) from None

    def read(self, piece: Piece, buf: torch.Tensor) -> torch.Tensor:
        """(reader thread, or the caller) The piece's bytes, verified, as a tensor in ``buf``; any
        failure a :class:`CheckpointError` (engine/guard.py)."""
        with mapped_errors("export", self.path):
            return self._read(piece, buf)

    def _read(self, piece: Piece, buf: torch.Tensor) -> torch.Tensor:
        entry = self.manifest.tensors[piece.name]
        if buf.numel() < piece.nbytes:  # a single row wider than the slab
            buf = torch.empty(piece.nbytes, dtype=torch.uint8)
        raw = buf[: piece.nbytes]
        if piece.chunk is not None:
            self._direct(piece, piece.chunk, tensor_bytes(raw))
            return raw.view(entry.dtype)
        shape = (piece.hi - piece.lo, *entry.shape[1:]) if entry.shape else ()
        out = raw.view(entry.dtype).view(shape)
        offsets = (piece.lo,) + (0,) * (len(entry.shape) - 1) if entry.shape else ()
        run_tasks(
            self.storage,
            self.path,
            self.manifest,
            plan_reads(piece.name, entry, out, offsets),
            _nothing,
            Deadline.after(self.timeout, "io"),
        )
        return out

    def _direct(self, piece: Piece, chunk: Chunk, out: memoryview) -> None:
        """Bytes of ``chunk`` from ``piece.start`` into ``out``, one checksum block per read, several
        reads at once (``SHARDSAFE_IO_THREADS``); each block is verified before it counts."""
        file = chunk_path(self.storage, self.path, chunk)
        block = self.manifest.block_bytes

        def one(offset: int) -> None:
            view = out[offset : offset + block]
            try:
                read_verified(self.storage, file, chunk, block, piece.start + offset, view, piece.name)
            except (EOFError, FileNotFoundError) as err:
                raise CorruptCheckpointError(f"{file}: cannot read tensor {piece.name!r}: {err}") from err

        futures = [self.io.submit(one, offset) for offset in range(0, len(out), block)]
        _, late = wait(futures, timeout=self.timeout)
        if late:
            raise CheckpointTimeoutError(
                f"export of {self.path!r}: reading {file} did not finish within {self.timeout:.0f}s (storage hung "
                "or far too slow); raise timeout= or SHARDSAFE_IO_TIMEOUT if it is merely slow"
            )
        for f in futures:
            f.result()  # the first failure, in order


def same_bytes(manifest: Manifest, reader: PieceReader, a: str, b: str, slab: int) -> bool:
    """Whether tensors ``a`` and ``b`` hold the same dtype, shape and bytes. Chunks laid out alike are
    compared by their block checksums (no read); otherwise both are read, verified, row range by row
    range, and compared byte for byte."""
    ta, tb = manifest.tensors[a], manifest.tensors[b]
    if ta.dtype != tb.dtype or ta.shape != tb.shape:
        return False
    layout_a = sorted((c.offsets, c.sizes, c.checksums) for c in ta.chunks)
    layout_b = sorted((c.offsets, c.sizes, c.checksums) for c in tb.chunks)
    if [x[:2] for x in layout_a] == [x[:2] for x in layout_b]:
        return layout_a == layout_b
    row = math.prod(ta.shape[1:]) * ta.dtype.itemsize if ta.shape else ta.nbytes
    rows = max(1, slab // max(row, 1))
    for lo in range(0, ta.shape[0] if ta.shape else 1, rows):
        hi = min(lo + rows, ta.shape[0]) if ta.shape else 1
        nbytes = (hi - lo) * row
        left = reader.read(Piece(a, nbytes, lo=lo, hi=hi), reader.buffers[0])
        right = reader.read(Piece(b, nbytes, lo=lo, hi=hi), reader.buffers[1])
        if not torch.equal(left.reshape(-1).view(torch.uint8), right.reshape(-1).view(torch.uint8)):
            return False
    return True


def _nothing() -> None:
    pass
