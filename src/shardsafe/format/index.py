"""The index of a data file (format v3, docs/format.md section 2): the content digest and block
checksums of every chunk, in header order, written as the file's last safetensors entry (``/index``,
a ``U8`` tensor) once the chunks' bytes are written and hashed, and covered as a whole by the
manifest's ``index_checksum`` for the file.

A reader that needs chunks of a file reads its header (checked against ``header_checksum``) and its
index (checked against ``index_checksum``), once per file (:func:`read_index`): together they give
each chunk's dtype code, sizes, byte range, block checksums and digest. Nothing is taken on trust
beyond the manifest: both checksums come from it, the header is parsed strictly and bounded by
``header_bytes``, and the index's length is what the header's chunks imply.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from shardsafe.errors import CorruptCheckpointError
from shardsafe.format import jsontext
from shardsafe.format.model import SAFETENSORS_DTYPES, FileEntry
from shardsafe.format.values import INT_LIMIT
from shardsafe.storage.base import Storage

INDEX_KEY = "/index"
"""The safetensors key of a data file's index: no tensor name starts with ``/`` but per-rank ones
(``/rank<r>/...``), so it names no chunk."""
DIGEST_BYTES = 16
"""A chunk's digest in the index: xxh3-128, canonical (big-endian) bytes."""
SUM_BYTES = 8
"""A block checksum in the index: xxh3-64, canonical (big-endian) bytes."""
HEADER_DEPTH = 3
"""A safetensors header nests three levels: the object, an entry, its ``shape``/``data_offsets``."""
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1}
_ITEMSIZE |= {"BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8, "C64": 8}
assert set(_ITEMSIZE) == set(SAFETENSORS_DTYPES.values())


def blocks(nbytes: int, block: int) -> int:
    """Checksum blocks of a chunk of ``nbytes`` (one for an empty chunk)."""
    return max(1, -(-nbytes // block))


def index_bytes(sizes: Sequence[int], block: int) -> int:
    """The length of the index of a file whose chunks have ``sizes`` bytes."""
    return sum(DIGEST_BYTES + SUM_BYTES * blocks(n, block) for n in sizes)


def encode_index(digests: Sequence[str], sums: Sequence[Sequence[str]]) -> bytes:
    """The index bytes of chunks with these digests and block checksums (hex, as the hashes print)."""
    return b"".join(bytes.fromhex(d) + bytes.fromhex("".join(s)) for d, s in zip(digests, sums, strict=True))


@dataclass(frozen=True)
class IndexEntry:
    """One chunk of a data file, as its header and index describe it: safetensors dtype code, sizes,
    absolute byte range, block checksums and digest."""

    code: str
    sizes: tuple[int, ...]
    begin: int
    end: int
    checksums: tuple[str, ...]
    digest: str


def parse_header(raw: bytes | bytearray, path: str, entry: FileEntry) -> dict[str, Any]:
    """The strict safetensors header of a file whose first ``header_bytes`` are ``raw`` (already
    checked against ``header_checksum``): UTF-8 JSON object padded with spaces, ``__metadata__`` of
    strings, every other entry exactly ``{"dtype", "shape", "data_offsets"}`` with a known dtype code,
    integer sizes and offsets. Only :class:`CorruptCheckpointError`."""
    (n,) = struct.unpack("<Q", raw[:8])
    if 8 + n != entry.header_bytes:
        raise CorruptCheckpointError(f"{path}: header length field {n} disagrees with the manifest")
    text = bytes(raw[8:]).rstrip(b" ")
    if not (text.startswith(b"{") and text.endswith(b"}")):
        raise CorruptCheckpointError(f"{path}: the safetensors header is not a JSON object padded with spaces")
    header = jsontext.parse(text, path, "the safetensors header", max_depth=HEADER_DEPTH)
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{path}: the safetensors header is not a JSON object")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptCheckpointError(f"{path}: the safetensors header's __metadata__ is not an object of strings")
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if not (
            isinstance(info, dict)
            and info.keys() == {"dtype", "shape", "data_offsets"}
            and info["dtype"] in _ITEMSIZE
            and isinstance(info["shape"], list)
            and isinstance(info["data_offsets"], list)
            and len(info["data_offsets"]) == 2
            and all(type(v) is int and 0 <= v <= INT_LIMIT for v in [*info["shape"], *info["data_offsets"]])
        ):
            raise CorruptCheckpointError(f"{path}: header entry {key[:80]!r} is not a safetensors tensor entry")
    return header


MAX_INDEX_BYTES = 2**30
"""Largest index a reader reads (a chunk of 1 TiB in 8 MiB blocks takes 1 MiB of it)."""


@dataclass(frozen=True)
class _Layout:
    """What a strict header says of a v3 file: its chunks (key, dtype code, sizes, byte range relative
    to the data region, block count) and where the index lies (relative to the data region)."""

    chunks: list[tuple[str, str, tuple[int, ...], int, int, int]]
    index_lo: int
    index_hi: int


def layout(header: dict[str, Any], path: str, entry: FileEntry, block: int) -> _Layout:
    """The chunks and index of a v3 file from its parsed header: chunks back to back from the data
    region's start in header order, each as long as its dtype and shape say, then the index entry
    (``U8``, as long as the chunks' digests and checksums take), which ends the file. Only
    :class:`CorruptCheckpointError`."""
    keys = [k for k in header if k != "__metadata__"]
    if not keys or keys[-1] != INDEX_KEY:
        raise CorruptCheckpointError(f"{path}: the safetensors header does not end with the index entry {INDEX_KEY!r}")
    chunks: list[tuple[str, str, tuple[int, ...], int, int, int]] = []
    pos = 0  # in the data region
    need = 0  # index bytes
    for key in keys[:-1]:
        info = header[key]
        a, b = info["data_offsets"]
        nbytes = math.prod(info["shape"]) * _ITEMSIZE[info["dtype"]]
        if a != pos or b - a != nbytes:
            raise CorruptCheckpointError(
                f"{path}: header entry {key[:80]!r} has bytes [{a}, {b}), expected {nbytes} bytes from {pos} (chunks "
                "lie back to back, in header order)"
            )
        k = blocks(nbytes, block)
        chunks.append((key, info["dtype"], tuple(info["shape"]), a, b, k))
        need += DIGEST_BYTES + SUM_BYTES * k
        pos = b
    info = header[INDEX_KEY]
    a, b = info["data_offsets"]
    if info["dtype"] != "U8" or info["shape"] != [need] or a != pos or b != pos + need:
        raise CorruptCheckpointError(
            f"{path}: the index entry {info} does not hold the {need} index bytes of the header's chunks right after "
            "them"
        )
    if entry.header_bytes + b != entry.size:
        raise CorruptCheckpointError(f"{path}: the index does not end the file ({entry.size} bytes)")
    if need > MAX_INDEX_BYTES:
        raise CorruptCheckpointError(f"{path}: an index of {need} bytes, more than a reader reads ({MAX_INDEX_BYTES})")
    return _Layout(chunks, a, b)


def entries(lay: _Layout, entry: FileEntry, index: bytes) -> dict[str, IndexEntry]:
    """Every chunk of a v3 file (:func:`layout`) with its checksums and digest from ``index`` (its
    bytes, already checked against ``index_checksum``)."""
    out: dict[str, IndexEntry] = {}
    at = 0
    base = entry.header_bytes
    width = 2 * SUM_BYTES
    for key, code, sizes, a, b, k in lay.chunks:
        take = DIGEST_BYTES + SUM_BYTES * k
        sums = index[at + DIGEST_BYTES : at + take].hex()
        out[key] = IndexEntry(
            code,
            sizes,
            base + a,
            base + b,
            tuple(sums[i : i + width] for i in range(0, len(sums), width)),
            index[at : at + DIGEST_BYTES].hex(),
        )
        at += take
    return out


@dataclass(frozen=True)
class FileIndex:
    """A data file's chunks by key (:class:`IndexEntry`), read and checked once (:func:`read_index`)."""

    path: str
    chunks: dict[str, IndexEntry]


def read_index(storage: Storage, path: str, entry: FileEntry, block: int) -> FileIndex:
    """(a reader) The index of the v3 data file at ``path``: its size checked against the manifest
    (a regular file), its header against ``header_checksum``, its index against ``index_checksum``;
    at most ``header_bytes`` plus the index are read. Raises :class:`CorruptCheckpointError` naming
    the file (a missing file included); ``OSError`` of the storage otherwise."""
    if entry.index_checksum is None:
        raise CorruptCheckpointError(
            f"{path}: the manifest lists no index for this file, yet a rule places chunks in it"
        )
    try:
        size = storage.size(path)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: data file missing") from None
    if size != entry.size:
        raise CorruptCheckpointError(f"{path}: {size} bytes, the manifest says {entry.size} (truncated or altered)")
    raw = bytearray(entry.header_bytes)
    try:
        storage.read_into(path, 0, memoryview(raw))
    except EOFError as err:
        raise CorruptCheckpointError(f"{path}: cannot read its header: {err}") from err
    if xxhash.xxh3_64_hexdigest(raw) != entry.header_checksum:
        raise CorruptCheckpointError(f"{path}: safetensors header checksum mismatch: the file is corrupt")
    header = parse_header(raw, path, entry)
    lay = layout(header, path, entry, block)
    index = bytearray(lay.index_hi - lay.index_lo)
    try:
        storage.read_into(path, entry.header_bytes + lay.index_lo, memoryview(index))
    except EOFError as err:
        raise CorruptCheckpointError(f"{path}: cannot read its index: {err}") from err
    if xxhash.xxh3_64_hexdigest(index) != entry.index_checksum:
        raise CorruptCheckpointError(f"{path}: index checksum mismatch: the file is corrupt")
    return FileIndex(path, entries(lay, entry, bytes(index)))
