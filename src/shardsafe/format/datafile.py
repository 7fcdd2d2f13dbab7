"""Data files: valid safetensors files (8-byte little-endian header length, JSON header padded with
spaces to a multiple of 8, then the raw bytes of each chunk, back to back, in header order, then
(format v3) the file's ruled chunks in one region and their block checksums, :mod:`shardsafe.format.index`).

Checksums are xxh3-64 over fixed-size blocks of each chunk, computed while the bytes are written (no
read-back pass) and verified for every block read, so a partial read is verified on its own. A block is
verified in a buffer of the reader's before any of its bytes reach a destination.
"""

from __future__ import annotations

import ctypes
import json
import struct
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import torch
import xxhash

from shardsafe.errors import CorruptCheckpointError
from shardsafe.format.index import INDEX_KEY, SHARDS_KEY, encode_index, index_bytes, parse_header, regions
from shardsafe.format.manifest import SAFETENSORS_DTYPES, Chunk, FileEntry
from shardsafe.storage.base import Storage, Writer


def digest(data: memoryview | bytearray | bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def content_digest(data: memoryview | bytearray | bytes) -> str:
    """The chunk digest of format v2 (xxh3-128 of the chunk's bytes): what an incremental save compares."""
    return xxhash.xxh3_128_hexdigest(data)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy: a writable view of its memory, which
    keeps the tensor alive as long as the view is. Needs no numpy (``Tensor.numpy()`` does, and numpy is
    not a dependency): a ctypes array over the tensor's memory, holding the tensor."""
    if tensor.device.type != "cpu" or tensor.layout != torch.strided or not tensor.is_contiguous():
        raise ValueError("tensor_bytes needs a contiguous CPU tensor")
    if tensor.is_conj() or tensor.is_neg():  # lazy views: their memory holds the bytes before the conjugation
        raise ValueError("tensor_bytes needs a tensor without a conjugate or negative bit (resolve_conj() first)")
    if sys.byteorder != "little":
        raise NotImplementedError("format v1 stores little-endian bytes; big-endian hosts are not supported")
    flat = tensor.detach().reshape(-1)
    nbytes = flat.numel() * flat.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    memory = (ctypes.c_uint8 * nbytes).from_address(flat.data_ptr())
    memory._tensor = flat  # type: ignore[attr-defined]  # the view holds the array, the array the tensor
    return memoryview(memory).cast("B")


class ChunkToWrite(Protocol):
    """What the writer needs of a planned chunk (:class:`shardsafe.engine.plan.PendingChunk` is one): its
    manifest tensor name, box, data-file key, size and the contiguous CPU tensor holding the bytes."""

    name: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    data: torch.Tensor

    @property
    def key(self) -> str: ...

    @property
    def nbytes(self) -> int: ...


def build_header(chunks: Sequence[ChunkToWrite], ruled: int = 0, block: int = 1) -> bytes:
    """The safetensors header (length prefix included) for ``chunks`` laid out in order: one entry per
    chunk, except (format v3) the last ``ruled`` ones, whose bytes are the ``/shards`` entry, followed by
    the ``/index`` entry of their checksum blocks of ``block`` bytes."""
    header: dict[str, object] = {"__metadata__": {"format": "pt", "writer": "shardsafe"}}
    pos = 0
    listed = len(chunks) - ruled
    for c in chunks[:listed]:
        header[c.key] = {
            "dtype": SAFETENSORS_DTYPES[c.data.dtype],
            "shape": list(c.sizes),
            "data_offsets": [pos, pos + c.nbytes],
        }
        pos += c.nbytes
    if ruled:
        sizes = [c.nbytes for c in chunks[listed:]]
        n, m = sum(sizes), index_bytes(sizes, block)
        header[SHARDS_KEY] = {"dtype": "U8", "shape": [n], "data_offsets": [pos, pos + n]}
        header[INDEX_KEY] = {"dtype": "U8", "shape": [m], "data_offsets": [pos + n, pos + n + m]}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % 8)
    return struct.pack("<Q", len(text)) + text


def write_file(
    writer: Writer,
    file: str,
    chunks: Sequence[ChunkToWrite],
    block: int,
    on_first_piece: Callable[[], None],
    windows: Iterable[memoryview] | None = None,
    ruled: int = 0,
) -> tuple[FileEntry, list[Chunk]]:
    """(a writing rank) Stream ``chunks`` into ``writer`` as one safetensors file, hashing each block as
    it goes; the last ``ruled`` chunks (format v3: those a sharding rule describes, in the order of
    section 2) as its ``/shards`` region, followed by its index of their block checksums. ``windows``
    are the chunks' bytes in order, cut anywhere (the save pipeline's staging windows); by default
    each chunk's own memory (contiguous CPU tensors). A window is hashed, then written, before the
    next is asked for. The caller closes (makes durable) or aborts the writer."""
    header = build_header(chunks, ruled, block)
    writer.write(memoryview(header))
    if windows is None:
        windows = _own_memory(chunks, block)
    hasher = _BlockHasher([c.nbytes for c in chunks], block)
    first = True
    for view in windows:
        hasher.feed(view)
        if len(view):
            writer.write(view)
        if first:
            first = False
            on_first_piece()
    sums = hasher.finish(file)
    if first:
        on_first_piece()
    index = encode_index(sums[len(chunks) - ruled :]) if ruled else b""
    if index:
        writer.write(memoryview(index))
    records: list[Chunk] = []
    pos = len(header)
    for c, chunk_sums, chunk_digest in zip(chunks, sums, hasher.digests, strict=True):
        records.append(Chunk(c.offsets, c.sizes, file, c.key, pos, pos + c.nbytes, tuple(chunk_sums), chunk_digest))
        pos += c.nbytes
    entry = FileEntry(
        size=pos + len(index),
        header_bytes=len(header),
        header_checksum=digest(header),
        index_checksum=digest(index) if ruled else None,
    )
    return entry, records


def _own_memory(chunks: Sequence[ChunkToWrite], piece: int) -> Iterator[memoryview]:
    for c in chunks:
        data = tensor_bytes(c.data)
        for start in range(0, len(data), piece):
            yield data[start : start + piece]


class _BlockHasher:
    """Checksums per block of each chunk (format v1), over bytes that arrive in windows cut anywhere:
    a block inside one window is hashed in one call, one split across windows incrementally (the same
    xxh3-64 value). An empty chunk has one checksum, of no bytes. Also each chunk's content digest
    (xxh3-128 of all its bytes, format v2), over the same windows while they are hot."""

    def __init__(self, sizes: Sequence[int], block: int) -> None:
        self.sizes = list(sizes)
        self.block = block
        self.sums: list[list[str]] = [[] for _ in sizes]
        self.digests: list[str] = []
        self.whole: Any = xxhash.xxh3_128()
        self.k = 0  # current chunk
        self.off = 0  # bytes of it hashed so far
        self.partial: Any = None  # running hash of a block split across windows
        self._skip_empty()

    def _skip_empty(self) -> None:
        while self.k < len(self.sizes) and self.off == self.sizes[self.k]:
            if self.sizes[self.k] == 0:
                self.sums[self.k].append(digest(b""))
            self.digests.append(self.whole.hexdigest())
            self.whole = xxhash.xxh3_128()
            self.k, self.off = self.k + 1, 0

    def feed(self, view: memoryview) -> None:
        pos = 0
        while pos < len(view):
            if self.k >= len(self.sizes):
                raise RuntimeError("shardsafe: the save pipeline produced more bytes than the chunks hold")
            size, block = self.sizes[self.k], self.block
            in_block = self.off % block
            take = min(len(view) - pos, block - in_block, size - self.off)
            part = view[pos : pos + take]
            self.whole.update(part)
            ends = in_block + take == block or self.off + take == size
            if in_block == 0 and ends:
                self.sums[self.k].append(digest(part))
            else:
                if self.partial is None:
                    self.partial = xxhash.xxh3_64()
                self.partial.update(part)
                if ends:
                    self.sums[self.k].append(self.partial.hexdigest())
                    self.partial = None
            pos += take
            self.off += take
            self._skip_empty()

    def finish(self, file: str) -> list[list[str]]:
        if self.k != len(self.sizes):
            raise RuntimeError(f"shardsafe: the save pipeline ended early while writing {file} (chunk {self.k})")
        return self.sums


def read_verified(
    storage: Storage, path: str, chunk: Chunk, block: int, start: int, out: memoryview, tensor: str
) -> None:
    """Fill ``out`` with the chunk's bytes at ``[start, start + len(out))`` (relative to the chunk). Each
    block those bytes touch is read into a private buffer and verified before any of it reaches ``out``."""

    def deliver(lo: int, data: memoryview) -> None:
        out[lo - start : lo - start + len(data)] = data

    read_blocks(storage, path, chunk, block, start, start + len(out), tensor, None, deliver)


def read_blocks(
    storage: Storage,
    path: str,
    chunk: Chunk,
    block: int,
    start: int,
    stop: int,
    tensor: str,
    bounce: Callable[[int], memoryview] | None,
    deliver: Callable[[int, memoryview], None] | None,
    cancelled: Callable[[], bool] = lambda: False,
) -> None:
    """Read the chunk's bytes ``[start, stop)`` block by block, each into ``bounce(n)`` (a private buffer
    of ``n`` bytes; by default one allocated here), verify it, and only then hand the part of it in range
    to ``deliver(offset, bytes)`` (offset relative to the chunk; ``deliver=None`` only verifies). Stops,
    delivering nothing more, once ``cancelled()`` is true. Raises :class:`CorruptCheckpointError` naming
    the file and tensor."""
    length = chunk.end - chunk.begin
    if length == 0:
        _check(path, chunk, 0, block, b"", tensor)
        return
    if bounce is None:
        own = memoryview(bytearray(min(block, length)))
        bounce = lambda n: own[:n]  # noqa: E731
    for k in range(start // block, -(-stop // block)):
        if cancelled():
            return
        lo, hi = k * block, min((k + 1) * block, length)
        view = bounce(hi - lo)
        storage.read_into(path, chunk.begin + lo, view)
        _check(path, chunk, k, block, view, tensor)
        if deliver is not None:
            a, b = max(lo, start), min(hi, stop)
            deliver(a, view[a - lo : b - lo])


def _check(path: str, chunk: Chunk, k: int, block: int, data: memoryview | bytearray | bytes, tensor: str) -> None:
    if digest(data) != chunk.checksums[k]:
        at = chunk.begin + k * block
        raise CorruptCheckpointError(
            f"{path}: checksum mismatch in tensor {tensor!r} (chunk at {list(chunk.offsets)}, file bytes "
            f"[{at}, {at + len(data)})): the file is corrupt. "
            "Load an older checkpoint or restore this file from a copy."
        )


def verify_header(
    storage: Storage,
    path: str,
    entry: FileEntry,
    chunks: Sequence[Chunk],
    dtypes: Sequence[torch.dtype],
    *,
    subset: bool = False,
) -> None:
    """Check a data file's size, header checksum, and that its safetensors header is strict (UTF-8
    JSON object, space padding, ``__metadata__`` of strings) and holds exactly the manifest's chunks
    of this file listed in the manifest (format v3: and, for a file with ruled chunks, its ``/shards``
    and ``/index`` entries, the last two, back to back), each with its dtype, shape and byte range.
    ``subset``: a file of a sibling checkpoint that the manifest refers to, whose header may hold
    chunks the manifest does not use, and whose ruled region may hold a referenced chunk. The ruled
    chunks and the index: :func:`~shardsafe.format.index.read_index`.
    Only :class:`CorruptCheckpointError`."""
    size = storage.size(path)
    if size != entry.size:
        raise CorruptCheckpointError(f"{path}: {size} bytes, the manifest says {entry.size} (truncated or altered)")
    raw = bytearray(entry.header_bytes)
    storage.read_into(path, 0, memoryview(raw))
    if digest(raw) != entry.header_checksum:
        raise CorruptCheckpointError(f"{path}: safetensors header checksum mismatch: the file is corrupt")
    header = parse_header(raw, path, entry)
    keys = {c.key for c in chunks}
    indexed = entry.index_checksum is not None
    shards = regions(header, path, entry).shards if indexed else (0, 0)  # entries back to back, index last
    ours = (SHARDS_KEY, INDEX_KEY) if indexed else ()
    extra = [k for k in header if k != "__metadata__" and k not in keys and k not in ours]
    if extra and not subset:
        raise CorruptCheckpointError(
            f"{path}: the safetensors header has entries the manifest does not list: {[k[:80] for k in extra[:3]]}"
        )
    for c, dtype in zip(chunks, dtypes, strict=True):
        info = header.get(c.key)
        if info is None and subset and shards[0] <= c.begin <= c.end <= shards[1]:
            continue  # a chunk a sibling holds by rule (v3): in its ruled region, checked by its block checksums
        want = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(c.sizes),
            "data_offsets": [c.begin - entry.header_bytes, c.end - entry.header_bytes],
        }
        if info != want:
            raise CorruptCheckpointError(f"{path}: header entry {c.key!r} disagrees with the manifest")
