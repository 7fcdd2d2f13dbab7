"""``MANIFEST.json``, the commit record of a checkpoint (format v1; docs/format.md is the spec).

Parsing validates everything a hostile file could get wrong: the version, every entry kind, file
names (plain names only), byte ranges against file sizes, chunk boxes against global shapes, byte
lengths against shapes and dtypes, and checksum counts against chunk lengths.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from shardsafe.errors import CorruptCheckpointError
from shardsafe.format.values import dtype_from_name, dtype_name, tensor_refs, validate

FORMAT_VERSION = 1
CHECKSUM_ALGORITHM = "xxh3-64"
SELF_CHECKSUM = "manifest_checksum"
"""Key of the manifest's own checksum: xxh3-64 of the canonical JSON of the document without it."""
OBJECT_KINDS = ("module", "optimizer", "stateful", "value")
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,254}$")

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


@dataclass(frozen=True)
class Chunk:
    """One box of a tensor, stored contiguously (row-major) in one data file."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    key: str
    begin: int
    end: int
    checksums: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "offsets": list(self.offsets),
            "sizes": list(self.sizes),
            "file": self.file,
            "key": self.key,
            "begin": self.begin,
            "end": self.end,
            "checksums": list(self.checksums),
        }


@dataclass(frozen=True)
class TensorEntry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class FileEntry:
    size: int
    header_bytes: int
    header_checksum: str


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

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

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
            "tensors": {
                name: {
                    "dtype": dtype_name(t.dtype),
                    "shape": list(t.shape),
                    "chunks": [c.to_json() for c in t.chunks],
                }
                for name, t in self.tensors.items()
            },
            "files": {
                name: {"size": f.size, "header_bytes": f.header_bytes, "header_checksum": f.header_checksum}
                for name, f in self.files.items()
            },
        }
        return json.dumps(seal_manifest(doc), separators=(",", ":"), allow_nan=False).encode()


def seal_manifest(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with its ``manifest_checksum`` (re)computed; the field is always last."""
    body = {k: v for k, v in doc.items() if k != SELF_CHECKSUM}
    return {**body, SELF_CHECKSUM: _self_checksum(body)}


def _self_checksum(doc: dict[str, Any]) -> str:
    body = {k: v for k, v in doc.items() if k != SELF_CHECKSUM}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return xxhash.xxh3_64_hexdigest(canonical.encode())


def check_file_name(name: Any, where: str) -> str:
    """A data file name must be a plain name inside the checkpoint: no ``/``, no ``..``, no hidden file."""
    if not isinstance(name, str) or not _FILE_NAME.match(name) or ".." in name:
        raise CorruptCheckpointError(f"{where}: file name {name!r} is not a plain name inside the checkpoint")
    return name


def parse_manifest(raw: bytes, where: str) -> Manifest:
    """Parse and validate ``MANIFEST.json`` bytes; ``where`` (its path) prefixes every error."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise CorruptCheckpointError(f"{where}: MANIFEST.json is not valid JSON ({err})") from err
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{where}: MANIFEST.json is not a JSON object")
    version = doc.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise CorruptCheckpointError(f"{where}: MANIFEST.json has no integer format_version")
    if version != FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"{where}: format_version {version} is not supported (this shardsafe reads {FORMAT_VERSION}); "
            "upgrade shardsafe to read it"
        )
    try:
        intact = doc.get(SELF_CHECKSUM) == _self_checksum(doc)
    except (TypeError, ValueError):
        intact = False
    if not intact:
        raise CorruptCheckpointError(
            f"{where}: MANIFEST.json fails its own checksum: it was altered or damaged. Load an older checkpoint."
        )
    try:
        return _build(doc, where)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise CorruptCheckpointError(f"{where}: malformed MANIFEST.json ({type(err).__name__}: {err})") from err


def _checked(node: Any, where: str) -> Any:
    validate(node, where, allow_pickle=False)
    return node


def _int(value: Any, what: str, where: str, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise CorruptCheckpointError(f"{where}: {what} is {value!r}, expected an integer >= {minimum}")
    return value


def _build(doc: dict[str, Any], where: str) -> Manifest:
    checksum = doc["checksum"]
    if checksum.get("algorithm") != CHECKSUM_ALGORITHM:
        raise CorruptCheckpointError(f"{where}: unknown checksum algorithm {checksum.get('algorithm')!r}")
    block = _int(checksum["block_bytes"], "checksum.block_bytes", where, 1)
    files: dict[str, FileEntry] = {}
    for name, f in doc["files"].items():
        check_file_name(name, where)
        size = _int(f["size"], f"files[{name}].size", where)
        header = _int(f["header_bytes"], f"files[{name}].header_bytes", where, 8)
        if header > size:
            raise CorruptCheckpointError(f"{where}: {name}: header of {header} bytes exceeds file size {size}")
        files[name] = FileEntry(size=size, header_bytes=header, header_checksum=str(f["header_checksum"]))
    tensors = {name: _tensor(name, t, files, block, where) for name, t in doc["tensors"].items()}
    objects: dict[str, dict[str, Any]] = {}
    for key, obj in doc["objects"].items():
        if obj.get("kind") not in OBJECT_KINDS:
            raise CorruptCheckpointError(f"{where}: entry {key!r} has unknown kind {obj.get('kind')!r}")
        validate(obj["value"], f"{where}: {key}", allow_pickle=True)
        for ref in tensor_refs(obj["value"]):
            if ref not in tensors:
                raise CorruptCheckpointError(f"{where}: entry {key!r} refers to missing tensor {ref!r}")
        objects[str(key)] = {"kind": obj["kind"], "value": obj["value"]}
    return Manifest(
        save_id=str(doc["save_id"]),
        created=float(doc["created"]),
        world_size=_int(doc["world_size"], "world_size", where, 1),
        strategy=str(doc["strategy"]),
        library={str(k): str(v) for k, v in doc.get("library", {}).items()},
        block_bytes=block,
        metadata=_checked(doc.get("metadata"), f"{where}: metadata"),
        objects=objects,
        tensors=tensors,
        files=files,
    )


def _tensor(name: str, t: dict[str, Any], files: dict[str, FileEntry], block: int, where: str) -> TensorEntry:
    here = f"{where}: tensor {name!r}"
    dtype = dtype_from_name(t["dtype"], here)
    if dtype not in SAFETENSORS_DTYPES:
        raise CorruptCheckpointError(f"{here}: dtype {t['dtype']!r} is not storable in format v1")
    shape = tuple(_int(d, "a shape dimension", here) for d in t["shape"])
    if math.prod(shape) * dtype.itemsize > 2**62:
        raise CorruptCheckpointError(f"{here}: shape {list(shape)} is absurdly large")
    chunks = []
    covered = 0
    for c in t["chunks"]:
        offsets = tuple(_int(v, "a chunk offset", here) for v in c["offsets"])
        sizes = tuple(_int(v, "a chunk size", here) for v in c["sizes"])
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise CorruptCheckpointError(f"{here}: chunk rank does not match shape {list(shape)}")
        if any(o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True)):
            raise CorruptCheckpointError(f"{here}: chunk {list(offsets)}+{list(sizes)} lies outside {list(shape)}")
        file = check_file_name(c["file"], here)
        if file not in files:
            raise CorruptCheckpointError(f"{here}: chunk refers to unlisted file {file!r}")
        begin, end = _int(c["begin"], "chunk begin", here), _int(c["end"], "chunk end", here)
        if not files[file].header_bytes <= begin <= end <= files[file].size:
            raise CorruptCheckpointError(
                f"{here}: byte range [{begin}, {end}) lies outside the data of {file} ({files[file].size} bytes)"
            )
        if end - begin != math.prod(sizes) * dtype.itemsize:
            raise CorruptCheckpointError(
                f"{here}: byte range of {end - begin} bytes does not fit a {list(sizes)} {dtype_name(dtype)} chunk"
            )
        checksums = tuple(str(h) for h in c["checksums"])
        if len(checksums) != max(1, -(-(end - begin) // block)):
            raise CorruptCheckpointError(f"{here}: {len(checksums)} checksums for {end - begin} bytes")
        covered += math.prod(sizes)
        chunks.append(Chunk(offsets, sizes, file, str(c["key"]), begin, end, checksums))
    if covered != math.prod(shape):
        raise CorruptCheckpointError(f"{here}: chunks hold {covered} elements, shape {list(shape)} needs more/less")
    _check_disjoint(chunks, here)
    return TensorEntry(dtype=dtype, shape=shape, chunks=tuple(chunks))


def _check_disjoint(chunks: list[Chunk], here: str) -> None:
    """Chunks must not overlap (with the element count equal to the shape's, they then tile it
    exactly). A sweep along dim 0 keeps this near-linear for the usual row-sharded chunks."""
    if len(chunks) < 2 or not chunks[0].offsets:
        if len(chunks) > 1:
            raise CorruptCheckpointError(f"{here}: a 0-d tensor has {len(chunks)} chunks")
        return
    boxes = sorted((c for c in chunks if math.prod(c.sizes) > 0), key=lambda c: c.offsets[0])
    for i, a in enumerate(boxes):
        end0 = a.offsets[0] + a.sizes[0]
        for b in boxes[i + 1 :]:
            if b.offsets[0] >= end0:
                break
            if all(
                bo < ao + asz and ao < bo + bsz
                for ao, asz, bo, bsz in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True)
            ):
                raise CorruptCheckpointError(f"{here}: chunks at {list(a.offsets)} and {list(b.offsets)} overlap")
