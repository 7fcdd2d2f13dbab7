"""The checkpoint's commit record as data: :class:`Manifest` and its entries, the constants of the
format (version, algorithms, storable dtypes), and the exact bytes a manifest is written as
(:meth:`Manifest.to_bytes`, :func:`seal_manifest`). Parsing and validating those bytes back is
:mod:`shardsafe.format.manifest` (docs/format.md is the spec)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from shardsafe.format.sharding import Mesh, Sharding
from shardsafe.format.values import dtype_name

FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
"""v2 adds a content digest per chunk and references into sibling checkpoints (``refs``); v3 adds
sharding rules (``meshes``, a tensor's ``sharding``), an index in every data file (``/index``,
covered by the file's ``index_checksum``) and side files (``side_files``: files written beside the
data under their own names, ``trainer_state.json``)."""
DIGEST_ALGORITHM = "xxh3-128"
CHECKSUM_ALGORITHM = "xxh3-64"
SELF_CHECKSUM = "manifest_checksum"
"""Key of the manifest's own checksum: xxh3-64 of the canonical JSON of the document without it."""
OBJECT_KINDS = ("module", "optimizer", "stateful", "value")
# safetensors dtype codes for the torch dtypes the format stores.
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.complex64: "C64",
}
STORABLE_DTYPES: dict[str, torch.dtype] = {dtype_name(d): d for d in SAFETENSORS_DTYPES}
"""Manifest dtype names (section 6) -> torch dtype: the only names a tensor entry may carry."""


@dataclass(frozen=True)
class Chunk:
    """One box of a tensor, stored contiguously (row-major) in one data file: of this checkpoint, or
    (``ref``, format v2) of the sibling checkpoint named ``ref``. ``digest``: xxh3-128 of the chunk's
    bytes (v2; ``None`` in a v1 manifest), what an incremental save compares."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    key: str
    begin: int
    end: int
    checksums: tuple[str, ...]
    digest: str | None = None
    ref: str | None = None

    def to_json(self, version: int = FORMAT_VERSION) -> dict[str, Any]:
        out: dict[str, Any] = {
            "offsets": list(self.offsets),
            "sizes": list(self.sizes),
            "file": self.file,
            "key": self.key,
            "begin": self.begin,
            "end": self.end,
            "checksums": list(self.checksums),
        }
        if version >= 2:
            out["digest"] = self.digest
            out["ref"] = self.ref
        return out


@dataclass(frozen=True)
class TensorEntry:
    """A tensor of the checkpoint: its ``chunks`` listed (every format), or (format v3) a ``sharding``
    rule whose chunks the data files' indexes describe (then ``chunks`` is empty)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]
    sharding: Sharding | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class FileEntry:
    """A data file: its size, header length and checksum, and (format v3) the checksum of its index
    (``None``: a file written by a v1 or v2 save, which has none)."""

    size: int
    header_bytes: int
    header_checksum: str
    index_checksum: str | None = None


@dataclass(frozen=True)
class RefEntry:
    """A sibling checkpoint this one refers to (format v2): the save id that wrote the files, and each
    referenced file's size and header checksum, checked before any byte of it is used."""

    save_id: str
    files: dict[str, FileEntry]


@dataclass(frozen=True)
class SideFile:
    """A side file of the checkpoint (format v3): a file of its own name in the checkpoint's folder, written
    whole by rank 0 before the commit; ``size`` its exact length, ``checksum`` the xxh3-64 of all its bytes."""

    size: int
    checksum: str


@dataclass
class Manifest:
    save_id: str
    created: float
    world_size: int
    strategy: str
    library: dict[str, str]
    block_bytes: int
    metadata: Any
    objects: dict[str, dict[str, Any]]
    tensors: dict[str, TensorEntry]
    files: dict[str, FileEntry]
    format_version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)
    refs: dict[str, RefEntry] = field(default_factory=dict)
    meshes: list[Mesh] = field(default_factory=list)
    """(v3) The writers' meshes the tensors' ``sharding`` rules refer to, by position."""
    side_files: dict[str, SideFile] = field(default_factory=dict)
    """(v3) Files written beside the data under their own names, with their sizes and checksums."""

    @property
    def total_bytes(self) -> int:
        """Bytes of this checkpoint's own data files (referenced ones not counted)."""
        return sum(f.size for f in self.files.values())

    @property
    def referenced_bytes(self) -> int:
        """Bytes of the sibling checkpoints' data files this one refers to."""
        return sum(f.size for r in self.refs.values() for f in r.files.values())

    def file_entry(self, chunk: Chunk) -> FileEntry:
        """The entry of the data file holding ``chunk`` (its own or a referenced one)."""
        return self.files[chunk.file] if chunk.ref is None else self.refs[chunk.ref].files[chunk.file]

    def to_bytes(self) -> bytes:
        doc = {
            "format_version": self.format_version,
            "save_id": self.save_id,
            "created": self.created,
            "world_size": self.world_size,
            "strategy": self.strategy,
            "library": self.library,
            "checksum": {"algorithm": CHECKSUM_ALGORITHM, "block_bytes": self.block_bytes},
            "metadata": self.metadata,
            "objects": self.objects,
            "tensors": {name: _tensor_json(t, self.format_version) for name, t in self.tensors.items()},
            "files": _files_json(self.files, self.format_version),
        }
        if self.format_version >= 2:
            doc["refs"] = {
                name: {"save_id": r.save_id, "files": _files_json(r.files, self.format_version)}
                for name, r in self.refs.items()
            }
        if self.format_version >= 3:
            doc["meshes"] = [m.to_json() for m in self.meshes]
            doc["side_files"] = {n: {"size": f.size, "checksum": f.checksum} for n, f in self.side_files.items()}
        else:
            assert not self.side_files, f"format version {self.format_version} holds no side files"
        return json.dumps(seal_manifest(doc), separators=(",", ":"), allow_nan=False, check_circular=False).encode()


def _tensor_json(t: TensorEntry, version: int) -> dict[str, Any]:
    out: dict[str, Any] = {"dtype": dtype_name(t.dtype), "shape": list(t.shape)}
    if t.sharding is not None:
        out["sharding"] = t.sharding.to_json()
    else:
        out["chunks"] = [c.to_json(version) for c in t.chunks]
    return out


def _files_json(files: dict[str, FileEntry], version: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, f in files.items():
        entry: dict[str, Any] = {"size": f.size, "header_bytes": f.header_bytes, "header_checksum": f.header_checksum}
        if version >= 3:
            entry["index_checksum"] = f.index_checksum
        out[name] = entry
    return out


def seal_manifest(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with its ``manifest_checksum`` (re)computed; the field is always last."""
    body = {k: v for k, v in doc.items() if k != SELF_CHECKSUM}
    return {**body, SELF_CHECKSUM: self_checksum(body)}


def self_checksum(doc: dict[str, Any]) -> str:
    body = {k: v for k, v in doc.items() if k != SELF_CHECKSUM}
    canonical = json.dumps(  # a parsed or built document is a tree: no cycle to look for (a third faster)
        body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False, check_circular=False
    )
    return xxhash.xxh3_64_hexdigest(canonical.encode())
