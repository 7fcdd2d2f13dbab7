"""The ruled chunks of a data file (format v3, docs/format.md section 2): their bytes lie in one
region, the safetensors entry ``/shards``, in the order the manifest's rules give (each chunk located
by that order and the sizes of the boxes before it, so no chunk needs an entry of its own), and
their block checksums in the file's index, the entry ``/index`` that ends the file, written once
the chunks' bytes are written and hashed and covered as a whole by the manifest's
``index_checksum`` for the file. A file without ruled chunks has neither entry (it is laid out as
in format v2).

A reader that needs ruled chunks of a file reads its header (checked against ``header_checksum``)
and its index (checked against ``index_checksum``), once per file (:func:`read_index`). Nothing is
taken on trust beyond the manifest: both checksums come from it, the header is parsed strictly and
bounded by ``header_bytes``, the entries lie back to back, and :mod:`shardsafe.format.resolve` checks
the region's and the index's lengths against the chunks the rules place in the file.
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

SHARDS_KEY = "/shards"
"""The safetensors key of a data file's region of ruled chunks: no tensor name starts with ``/`` but
per-rank ones (``/rank<r>/...``), so it names no chunk."""
INDEX_KEY = "/index"
"""The safetensors key of a data file's index (the block checksums of its ruled chunks)."""
SUM_BYTES = 8
"""A block checksum in the index: xxh3-64, canonical (big-endian) bytes."""
HEADER_DEPTH = 3
"""A safetensors header nests three levels: the object, an entry, its ``shape``/``data_offsets``."""
MAX_INDEX_BYTES = 2**30
"""Largest index a reader reads (a chunk of 1 TiB in 8 MiB blocks takes 1 MiB of it)."""
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1}
_ITEMSIZE |= {"BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8, "C64": 8}
assert set(_ITEMSIZE) == set(SAFETENSORS_DTYPES.values())


def blocks(nbytes: int, block: int) -> int:
    """Checksum blocks of a chunk of ``nbytes`` (one for an empty chunk)."""
    return max(1, -(-nbytes // block))


def index_bytes(sizes: Sequence[int], block: int) -> int:
    """The length of the index of a file whose ruled chunks have ``sizes`` bytes."""
    return SUM_BYTES * sum(blocks(n, block) for n in sizes)


def encode_index(sums: Sequence[Sequence[str]]) -> bytes:
    """The index bytes of ruled chunks with these block checksums (hex, as the hashes print)."""
    return bytes.fromhex("".join(s for chunk in sums for s in chunk))


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
            and isinstance(info["dtype"], str)  # a hostile header's dict or list is unhashable: refused, not raised
            and info["dtype"] in _ITEMSIZE
            and isinstance(info["shape"], list)
            and isinstance(info["data_offsets"], list)
            and len(info["data_offsets"]) == 2
            and all(type(v) is int and 0 <= v <= INT_LIMIT for v in [*info["shape"], *info["data_offsets"]])
        ):
            raise CorruptCheckpointError(f"{path}: header entry {key[:80]!r} is not a safetensors tensor entry")
    return header


@dataclass(frozen=True)
class Regions:
    """Where a v3 data file's ruled chunks and their index lie (absolute byte ranges), from its header."""

    shards: tuple[int, int]
    index: tuple[int, int]


def regions(header: dict[str, Any], path: str, entry: FileEntry) -> Regions:
    """The ``/shards`` and ``/index`` entries of a v3 data file's (parsed, strict) header: its last two,
    in that order, each ``U8`` of one dimension, back to back after the file's other entries (which
    lie back to back from the data region's start, each as long as its dtype and shape say), the
    index ending the file and a whole number of checksums, at most :data:`MAX_INDEX_BYTES`. Only
    :class:`CorruptCheckpointError`."""
    keys = [k for k in header if k != "__metadata__"]
    if keys[-2:] != [SHARDS_KEY, INDEX_KEY]:
        raise CorruptCheckpointError(
            f"{path}: the safetensors header does not end with the entries {SHARDS_KEY!r} and {INDEX_KEY!r}"
        )
    pos = 0
    for key in keys[:-2]:
        info = header[key]
        a, b = info["data_offsets"]
        if a != pos or b - a != math.prod(info["shape"]) * _ITEMSIZE[info["dtype"]]:
            raise CorruptCheckpointError(
                f"{path}: header entry {key[:80]!r} has bytes [{a}, {b}), not its {info['dtype']} {info['shape']} from "
                f"{pos} (entries lie back to back, in header order)"
            )
        pos = b
    spans = []
    for key in (SHARDS_KEY, INDEX_KEY):
        info = header[key]
        a, b = info["data_offsets"]
        if info["dtype"] != "U8" or info["shape"] != [b - a] or a != pos:
            raise CorruptCheckpointError(f"{path}: the {key!r} entry {info} is not the U8 bytes that follow from {pos}")
        spans.append((entry.header_bytes + a, entry.header_bytes + b))
        pos = b
    if entry.header_bytes + pos != entry.size:
        raise CorruptCheckpointError(f"{path}: the index does not end the file ({entry.size} bytes)")
    length = spans[1][1] - spans[1][0]
    if length % SUM_BYTES or length > MAX_INDEX_BYTES:
        raise CorruptCheckpointError(
            f"{path}: an index of {length} bytes (a whole number of 8-byte checksums, at most 2^30)"
        )
    return Regions(spans[0], spans[1])


@dataclass(frozen=True)
class FileIndex:
    """A v3 data file's ruled region and index, read and checked once (:func:`read_index`): ``sums`` are
    the block checksums of its ruled chunks, in order, as hex."""

    path: str
    shards: tuple[int, int]
    sums: list[str]

    @property
    def nbytes(self) -> int:
        """Bytes of the index."""
        return SUM_BYTES * len(self.sums)


def read_index(storage: Storage, path: str, entry: FileEntry) -> FileIndex:
    """(a reader) The ruled region and index of the v3 data file at ``path``: its size checked against
    the manifest (a regular file), its header against ``header_checksum`` (and parsed strictly), its
    index against ``index_checksum``; at most ``header_bytes`` plus the index are read. Raises
    :class:`CorruptCheckpointError` naming the file (a missing file included)."""
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
    where = regions(parse_header(raw, path, entry), path, entry)
    index = bytearray(where.index[1] - where.index[0])
    try:
        storage.read_into(path, where.index[0], memoryview(index))
    except EOFError as err:
        raise CorruptCheckpointError(f"{path}: cannot read its index: {err}") from err
    if xxhash.xxh3_64_hexdigest(index) != entry.index_checksum:
        raise CorruptCheckpointError(f"{path}: index checksum mismatch: the file is corrupt")
    text = index.hex()
    width = 2 * SUM_BYTES
    return FileIndex(path, where.shards, [text[i : i + width] for i in range(0, len(text), width)])
