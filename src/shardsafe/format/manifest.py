"""``MANIFEST.json``, the commit record of a checkpoint (format v3, reads v1 and v2; docs/format.md is the spec).

Parsing is one strict validation pass (docs/format.md, section 8) over everything a hostile file could
get wrong: UTF-8 JSON of bounded size and depth, the version and self-checksum, every field present
with its JSON type and nothing else, integers in range, every entry kind, file names (plain names
only, ``fullmatch``), dtypes from a fixed table, byte ranges against file sizes, chunk boxes against
global shapes (disjoint, tiling the shape), byte lengths against shapes and dtypes, checksum lists,
sharding rules against their meshes and shapes (v3: bounded, whatever they claim), and every typed
value. The only exception it raises is :class:`CorruptCheckpointError`.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from shardsafe.errors import CorruptCheckpointError
from shardsafe.format import jsontext
from shardsafe.format.model import (
    CHECKSUM_ALGORITHM,
    DIGEST_ALGORITHM,
    FORMAT_VERSION,
    OBJECT_KINDS,
    READABLE_VERSIONS,
    SAFETENSORS_DTYPES,
    SELF_CHECKSUM,
    STORABLE_DTYPES,
    Chunk,
    FileEntry,
    Manifest,
    RefEntry,
    SideFile,
    TensorEntry,
    seal_manifest,
    self_checksum,
)
from shardsafe.format.names import SAVE_ID, is_data_file_of, side_file_problem
from shardsafe.format.sharding import BOX_BUDGET, MAX_MESH_DIMS, Mesh, Sharding, box_bound
from shardsafe.format.tiling import check_tiling
from shardsafe.format.values import INT_LIMIT, MAX_DIMS, dtype_name, validate
from shardsafe.format.walk import per_rank_counts, tensor_refs

__all__ = [  # the model (format/model.py) is imported from here too
    "CHECKSUM_ALGORITHM",
    "CREATED_LIMIT",
    "DIGEST_ALGORITHM",
    "FORMAT_VERSION",
    "INT_LIMIT",
    "MAX_DEPTH",
    "MAX_DIMS",
    "MAX_HEADER_BYTES",
    "OBJECT_KINDS",
    "READABLE_VERSIONS",
    "SAFETENSORS_DTYPES",
    "SELF_CHECKSUM",
    "STORABLE_DTYPES",
    "Chunk",
    "FileEntry",
    "Manifest",
    "Mesh",
    "RefEntry",
    "Sharding",
    "SideFile",
    "TensorEntry",
    "build_manifest",
    "check_file_name",
    "parse_manifest",
    "seal_manifest",
    "self_checksum",
]

MAX_DEPTH = 128
"""Most levels of JSON arrays and objects in a manifest (a typed value inside is capped lower)."""
MAX_HEADER_BYTES = 8 + 100_000_000
"""Largest ``header_bytes`` of a data file: safetensors' own limit on the JSON header, plus the prefix."""
CREATED_LIMIT = 2**34
"""``created`` is a Unix time between 0 and this (the year 2514)."""

_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")
_DIGEST = re.compile(r"[0-9a-f]{16}")
_DIGEST128 = re.compile(r"[0-9a-f]{32}")
_FIELDS_V1 = frozenset(
    {
        "format_version",
        "save_id",
        "created",
        "world_size",
        "strategy",
        "library",
        "checksum",
        "metadata",
        "objects",
        "tensors",
        "files",
        SELF_CHECKSUM,
    }
)
_FIELDS_V2 = _FIELDS_V1 | {"refs"}
_FIELDS_V3 = _FIELDS_V2 | {"meshes", "side_files"}
_FIELDS = {1: _FIELDS_V1, 2: _FIELDS_V2, 3: _FIELDS_V3}
_SIDE_FIELDS = frozenset({"size", "checksum"})
_REF_FIELDS = frozenset({"save_id", "files"})
_CHECKSUM_FIELDS = frozenset({"algorithm", "block_bytes"})
_FILE_FIELDS_V2 = frozenset({"size", "header_bytes", "header_checksum"})
_FILE_FIELDS = _FILE_FIELDS_V2 | {"index_checksum"}
_TENSOR_FIELDS = frozenset({"dtype", "shape", "chunks"})
_RULED_FIELDS = frozenset({"dtype", "shape", "sharding"})
_SHARDING_FIELDS = frozenset({"mesh", "dims"})
_MESH_FIELDS = frozenset({"shape", "ranks"})
_CHUNK_FIELDS_V1 = frozenset({"offsets", "sizes", "file", "key", "begin", "end", "checksums"})
_CHUNK_FIELDS = _CHUNK_FIELDS_V1 | {"digest", "ref"}
_OBJECT_FIELDS = frozenset({"kind", "value"})


def check_file_name(name: Any, where: str) -> str:
    """A data file name must be a plain name inside the checkpoint: no ``/``, no ``..``, no hidden file."""
    if not isinstance(name, str) or not _FILE_NAME.fullmatch(name) or ".." in name:
        raise CorruptCheckpointError(f"{where}: file name {_short(name)} is not a plain name inside the checkpoint")
    return name


def parse_manifest(raw: bytes, where: str) -> Manifest:
    """Parse and validate ``MANIFEST.json`` bytes; ``where`` (its path) prefixes every error, the only
    exception raised is :class:`CorruptCheckpointError`."""
    doc = jsontext.parse(raw, where, "MANIFEST.json", max_depth=MAX_DEPTH)
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{where}: MANIFEST.json is not a JSON object")
    version = doc.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise CorruptCheckpointError(f"{where}: MANIFEST.json has no integer format_version")
    if version not in READABLE_VERSIONS:
        raise CorruptCheckpointError(
            f"{where}: format_version {_short(version)} is not supported (this shardsafe reads "
            f"{', '.join(map(str, READABLE_VERSIONS))}); "
            "upgrade shardsafe to read it"
        )
    try:
        intact = doc.get(SELF_CHECKSUM) == self_checksum(doc)
    except (TypeError, ValueError):
        intact = False
    if not intact:
        raise CorruptCheckpointError(
            f"{where}: MANIFEST.json fails its own checksum: it was altered or damaged. Load an older checkpoint."
        )
    return build_manifest(doc, where)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _obj(value: Any, what: str, where: str, fields: frozenset[str] | None = None) -> dict[str, Any]:
    """``value`` as a JSON object; with ``fields``, holding exactly those."""
    if not isinstance(value, dict):
        raise CorruptCheckpointError(f"{where}: {what} is {_short(value)}, expected a JSON object")
    if fields is not None and value.keys() != fields:
        missing, extra = sorted(fields - value.keys()), sorted(value.keys() - fields)
        raise CorruptCheckpointError(
            f"{where}: {what} " + (f"lacks field(s) {missing}" if missing else f"has unexpected field(s) {extra}")
        )
    return value


def _list(value: Any, what: str, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise CorruptCheckpointError(f"{where}: {what} is {_short(value)}, expected a JSON array")
    return value


def _int(value: Any, what: str, where: str, minimum: int = 0, maximum: int = INT_LIMIT) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= maximum:
        raise CorruptCheckpointError(
            f"{where}: {what} is {_short(value)}, expected an integer >= {minimum} (and <= {maximum})"
        )
    return value


def _ints(value: Any, what: str, where: str, count: int | None = None) -> tuple[int, ...]:
    items = _list(value, f"the {what}s", where)
    if count is not None and len(items) != count:
        raise CorruptCheckpointError(
            f"{where}: {len(items)} {what}s, the shape has {count} dimensions (chunk rank does not match shape)"
        )
    return tuple(_int(v, f"a {what}", where) for v in items)


def _text(
    value: Any, what: str, where: str, pattern: re.Pattern[str] | None = None, limit: int = 256, printable: bool = True
) -> str:
    """A string matching ``pattern`` in full, or else non-empty, at most ``limit`` characters and
    (unless ``printable`` is false: names taken from the user's state) printable."""
    ok = isinstance(value, str) and (
        pattern.fullmatch(value) is not None
        if pattern
        else 0 < len(value) <= limit and (value.isprintable() or not printable)
    )
    if not ok:
        raise CorruptCheckpointError(f"{where}: {what} is {_short(value)}, not a valid name")
    return str(value)


def build_manifest(doc: dict[str, Any], where: str) -> Manifest:
    """The :class:`Manifest` of a parsed, sealed document, every field checked (section 8)."""
    version = doc.get("format_version")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        raise CorruptCheckpointError(f"{where}: format_version {_short(version)} is not supported")
    _obj(doc, "MANIFEST.json", where, _FIELDS[version])
    checksum = _obj(doc["checksum"], "checksum", where, _CHECKSUM_FIELDS)
    if checksum["algorithm"] != CHECKSUM_ALGORITHM:
        raise CorruptCheckpointError(f"{where}: unknown checksum algorithm {_short(checksum['algorithm'])}")
    block = _int(checksum["block_bytes"], "checksum.block_bytes", where, 1)
    created = doc["created"]
    if isinstance(created, bool) or not isinstance(created, (int, float)) or not 0 <= created <= CREATED_LIMIT:
        raise CorruptCheckpointError(f"{where}: created is {_short(created)}, expected a Unix time from 0 to 2^34")
    library = _obj(doc["library"], "library", where)
    world = _int(doc["world_size"], "world_size", where, 1, 2**31 - 1)
    files = {
        check_file_name(name, where): _file(name, f, where, version)
        for name, f in _obj(doc["files"], "files", where).items()
    }
    refs = _refs(doc["refs"], where, version) if version >= 2 else {}
    meshes = _meshes(doc["meshes"], world, where) if version >= 3 else []
    side_files = _side_files(doc["side_files"], files, where) if version >= 3 else {}
    memo: dict[Any, Sharding] = {}
    tensors = {
        _text(name, "a tensor name", where, limit=65536, printable=False): _tensor(
            name, t, files, refs, meshes, block, where, version, memo
        )
        for name, t in _obj(doc["tensors"], "tensors", where).items()
    }
    used = {c.ref for t in tensors.values() for c in t.chunks}
    unused = sorted(set(refs) - used)
    if unused:
        raise CorruptCheckpointError(f"{where}: refs lists {unused[:3]}, which no chunk refers to")
    objects = {key: _object(key, obj, tensors, where) for key, obj in _obj(doc["objects"], "objects", where).items()}
    for key, obj in objects.items():
        wrong = [n for n in per_rank_counts(obj["value"]) if n != world]
        if wrong:
            raise CorruptCheckpointError(
                f"{where}: entry {key!r} holds a per-rank value of {wrong[0]} ranks in a checkpoint saved by {world}"
            )
    metadata = doc["metadata"]
    validate(metadata, f"{where}: metadata", allow_pickle=False)
    if tensor_refs(metadata):
        raise CorruptCheckpointError(f"{where}: metadata refers to tensors {tensor_refs(metadata)[:3]}; it holds none")
    return Manifest(
        save_id=_text(doc["save_id"], "save_id", where, SAVE_ID),
        created=float(created),
        world_size=world,
        strategy=_text(doc["strategy"], "strategy", where, limit=64),
        library={_text(k, "a library name", where): _text(v, f"library[{k}]", where) for k, v in library.items()},
        block_bytes=block,
        metadata=metadata,
        objects=objects,
        tensors=tensors,
        files=files,
        format_version=version,
        refs=refs,
        meshes=meshes,
        side_files=side_files,
    )


def _side_files(value: Any, files: dict[str, FileEntry], where: str) -> dict[str, SideFile]:
    """The ``side_files`` table (v3): side file name -> its size and xxh3-64 checksum. Every name is one the
    writer may give a side file (:func:`~shardsafe.format.names.side_file_problem`), never a data file's."""
    out: dict[str, SideFile] = {}
    for name, f in _obj(value, "side_files", where).items():
        problem = side_file_problem(name)
        if problem is not None or name in files:
            raise CorruptCheckpointError(f"{where}: side_files: {problem or f'{name!r} is a data file'}")
        what = f"side_files[{name}]"
        f = _obj(f, what, where, _SIDE_FIELDS)
        size = _int(f["size"], f"{what}.size", where)
        out[name] = SideFile(size=size, checksum=_text(f["checksum"], f"{what}.checksum", where, _DIGEST))
    return out


def _refs(value: Any, where: str, version: int) -> dict[str, RefEntry]:
    """The ``refs`` table (v2): sibling checkpoint name -> save id and the files referenced in it. A
    name is validated like a file name (a single plain path component: no ``/``, ``\\``, ``..``,
    no hidden name), so a reference can only point into a sibling under the same parent; each file
    is a data file of that save id."""
    out: dict[str, RefEntry] = {}
    for name, r in _obj(value, "refs", where).items():
        check_file_name(name, f"{where}: refs")
        what = f"refs[{name}]"
        r = _obj(r, what, where, _REF_FIELDS)
        sid = _text(r["save_id"], f"{what}.save_id", where, SAVE_ID)
        files = {}
        for fname, f in _obj(r["files"], f"{what}.files", where).items():
            check_file_name(fname, f"{where}: {what}")
            if not is_data_file_of(fname, sid):
                raise CorruptCheckpointError(f"{where}: {what} lists {_short(fname)}, not a data file of save {sid}")
            files[fname] = _file(fname, f, where, version)
        if not files:
            raise CorruptCheckpointError(f"{where}: {what} lists no files")
        out[name] = RefEntry(save_id=sid, files=files)
    return out


def _file(name: str, f: Any, where: str, version: int) -> FileEntry:
    """A ``files`` entry (v3: with the index checksum, ``null`` for a file holding no ruled chunk)."""
    what = f"files[{name}]"
    f = _obj(f, what, where, _FILE_FIELDS if version >= 3 else _FILE_FIELDS_V2)
    size = _int(f["size"], f"{what}.size", where, 8)
    header = _int(f["header_bytes"], f"{what}.header_bytes", where, 8, min(size, MAX_HEADER_BYTES))
    if header % 8:
        raise CorruptCheckpointError(f"{where}: {what}.header_bytes is {header}, not a multiple of 8")
    digest = _text(f["header_checksum"], f"{what}.header_checksum", where, _DIGEST)
    index = None
    if version >= 3 and f["index_checksum"] is not None:
        index = _text(f["index_checksum"], f"{what}.index_checksum", where, _DIGEST)
    return FileEntry(size=size, header_bytes=header, header_checksum=digest, index_checksum=index)


def _meshes(value: Any, world: int, where: str) -> list[Mesh]:
    """The writers' meshes (v3): each a shape of at most :data:`MAX_MESH_DIMS` dimensions, each >= 1,
    and as many ranks as the shape has coordinates, each a rank of the saving world, none twice."""
    out = []
    for i, m in enumerate(_list(value, "meshes", where)):
        what = f"meshes[{i}]"
        m = _obj(m, what, where, _MESH_FIELDS)
        dims = _list(m["shape"], f"{what}.shape", where)
        if len(dims) > MAX_MESH_DIMS:
            raise CorruptCheckpointError(f"{where}: {what} has {len(dims)} dimensions, more than {MAX_MESH_DIMS}")
        shape = tuple(_int(d, f"a dimension of {what}", where, 1, world) for d in dims)
        ranks = _list(m["ranks"], f"{what}.ranks", where)
        count = 1
        for d in shape:
            count *= d
            if count > len(ranks):
                break
        if count != len(ranks):
            raise CorruptCheckpointError(
                f"{where}: {what} lists {len(ranks)} ranks, not one per coordinate of its shape {list(shape)}"
            )
        writers = tuple(_int(r, f"a rank of {what}", where, 0, world - 1) for r in ranks)
        if len(set(writers)) != len(writers):
            raise CorruptCheckpointError(f"{where}: {what} lists a rank more than once (each writes one coordinate)")
        out.append(Mesh(shape, writers))
    return out


def _sharding(
    rule: Any, shape: tuple[int, ...], meshes: list[Mesh], here: str, memo: dict[Any, Sharding] | None = None
) -> Sharding:
    """A tensor's sharding rule (v3): a mesh of ``meshes``, and per mesh dimension a tensor dimension
    and a split factor from 1 to :data:`BOX_BUDGET`, the boxes of one coordinate at most that many.
    ``memo``: rules already checked (every layer's tensors repeat a few), by their plain-integer form."""
    key = _plain_rule(rule, len(shape))
    known = memo.get(key) if memo is not None and key is not None else None
    if known is not None:
        return known
    rule = _obj(rule, "the sharding", here, _SHARDING_FIELDS)
    if not meshes:
        raise CorruptCheckpointError(f"{here}: a sharding rule, but the manifest lists no meshes")
    mesh = _int(rule["mesh"], "the sharding's mesh", here, 0, len(meshes) - 1)
    dims = _list(rule["dims"], "the sharding's dims", here)
    if len(dims) != len(meshes[mesh].shape):
        raise CorruptCheckpointError(
            f"{here}: the sharding gives {len(dims)} dims for mesh {mesh} of {len(meshes[mesh].shape)} dimensions"
        )
    pairs = []
    for pair in dims:
        pair = _list(pair, "a sharding dim", here)
        if len(pair) != 2:
            raise CorruptCheckpointError(f"{here}: a sharding dim is {_short(pair)}, expected [tensor dim, factor]")
        if not shape:
            raise CorruptCheckpointError(f"{here}: a 0-d tensor cannot be split")
        pairs.append(
            (
                _int(pair[0], "a sharding's tensor dim", here, 0, len(shape) - 1),
                _int(pair[1], "a sharding's split factor", here, 1, BOX_BUDGET),
            )
        )
    if box_bound(pairs) > BOX_BUDGET:
        raise CorruptCheckpointError(
            f"{here}: the sharding's split factors could make {box_bound(pairs)} boxes per coordinate, more than "
            f"{BOX_BUDGET}"
        )
    out = Sharding(mesh, tuple(pairs))
    if memo is not None and key is not None:
        memo[key] = out
    return out


def _plain_rule(rule: Any, ndim: int) -> tuple[Any, ...] | None:
    """A sharding made of plain JSON integers only, as a hashable key (with the tensor's rank, which
    bounds its dims); ``None`` for anything else (checked field by field instead)."""
    if type(rule) is not dict or rule.keys() != _SHARDING_FIELDS or type(rule["mesh"]) is not int:
        return None
    dims = rule["dims"]
    if type(dims) is not list or not all(
        type(p) is list and len(p) == 2 and type(p[0]) is int and type(p[1]) is int for p in dims
    ):
        return None
    return (rule["mesh"], tuple((p[0], p[1]) for p in dims), ndim)


def _object(key: Any, obj: Any, tensors: dict[str, TensorEntry], where: str) -> dict[str, Any]:
    if not isinstance(key, str) or not key or "/" in key:
        raise CorruptCheckpointError(f"{where}: entry name {_short(key)} is not a non-empty name without '/'")
    obj = _obj(obj, f"entry {key!r}", where, _OBJECT_FIELDS)
    if not isinstance(obj["kind"], str) or obj["kind"] not in OBJECT_KINDS:
        raise CorruptCheckpointError(f"{where}: entry {key!r} has unknown kind {_short(obj['kind'])}")
    validate(obj["value"], f"{where}: {key}", allow_pickle=True)  # a loader refuses pickle unless allowed
    for ref in tensor_refs(obj["value"]):
        if ref not in tensors:
            raise CorruptCheckpointError(f"{where}: entry {key!r} refers to missing tensor {_short(ref)}")
    return {"kind": obj["kind"], "value": obj["value"]}


def _tensor(
    name: str,
    t: Any,
    files: dict[str, FileEntry],
    refs: dict[str, RefEntry],
    meshes: list[Mesh],
    block: int,
    where: str,
    version: int,
    memo: dict[Any, Sharding] | None = None,
) -> TensorEntry:
    here = f"{where}: tensor {name!r}"
    ruled = version >= 3 and isinstance(t, dict) and "sharding" in t
    t = _obj(t, "the entry", here, _RULED_FIELDS if ruled else _TENSOR_FIELDS)
    dtype = STORABLE_DTYPES.get(t["dtype"]) if isinstance(t["dtype"], str) else None
    if dtype is None:
        raise CorruptCheckpointError(
            f"{here}: dtype {_short(t['dtype'])} is not one of the format's (docs/format.md, section 6)"
        )
    dims = _list(t["shape"], "shape", here)
    if len(dims) > MAX_DIMS:
        raise CorruptCheckpointError(f"{here}: shape has {len(dims)} dimensions, more than {MAX_DIMS}")
    shape = tuple(_int(d, "a shape dimension", here) for d in dims)
    if math.prod(max(d, 1) for d in shape) * dtype.itemsize > INT_LIMIT:
        raise CorruptCheckpointError(f"{here}: shape {list(shape)} is absurdly large")
    if ruled:
        rule = _sharding(t["sharding"], shape, meshes, here, memo)
        return TensorEntry(dtype=dtype, shape=shape, chunks=(), sharding=rule)
    records = _list(t["chunks"], "chunks", here)
    if not records:
        raise CorruptCheckpointError(
            f"{here}: has no chunks (chunks hold 0 elements); every tensor, even an empty one, has one"
        )
    if not shape and len(records) != 1:
        raise CorruptCheckpointError(f"{here}: a 0-d tensor has {len(records)} chunks")
    chunks = [_chunk(c, shape, dtype, files, refs, block, here, version) for c in records]
    covered = sum(math.prod(c.sizes) for c in chunks)
    if covered != math.prod(shape):
        raise CorruptCheckpointError(
            f"{here}: chunks hold {covered} elements, shape {list(shape)} holds {math.prod(shape)}"
        )
    check_tiling(shape, [(c.offsets, c.sizes) for c in chunks], here)
    return TensorEntry(dtype=dtype, shape=shape, chunks=tuple(chunks))


def _chunk(
    c: Any,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    files: dict[str, FileEntry],
    refs: dict[str, RefEntry],
    block: int,
    here: str,
    version: int,
) -> Chunk:
    c = _obj(c, "a chunk record", here, _CHUNK_FIELDS if version >= 2 else _CHUNK_FIELDS_V1)
    digest: str | None = None
    ref: str | None = None
    if version >= 2:
        digest = _text(c["digest"], "chunk digest", here, _DIGEST128)
        if c["ref"] is not None:
            ref = check_file_name(c["ref"], f"{here}: chunk ref")
            if ref not in refs:
                raise CorruptCheckpointError(f"{here}: chunk refers to checkpoint {ref!r}, which refs does not list")
            files = refs[ref].files
    offsets = _ints(c["offsets"], "chunk offset", here, len(shape))
    sizes = _ints(c["sizes"], "chunk size", here, len(shape))
    if any(o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True)):
        raise CorruptCheckpointError(f"{here}: chunk {list(offsets)}+{list(sizes)} lies outside {list(shape)}")
    file = check_file_name(c["file"], here)
    if file not in files:
        where_file = f" of referenced checkpoint {ref!r}" if ref is not None else ""
        raise CorruptCheckpointError(f"{here}: chunk refers to unlisted file {file!r}{where_file}")
    key = _text(c["key"], "chunk key", here, limit=65600, printable=False)
    begin, end = _int(c["begin"], "chunk begin", here), _int(c["end"], "chunk end", here)
    if not files[file].header_bytes <= begin <= end <= files[file].size:
        raise CorruptCheckpointError(
            f"{here}: byte range [{begin}, {end}) lies outside the data of {file} ({files[file].size} bytes)"
        )
    if end - begin != math.prod(sizes) * dtype.itemsize:
        raise CorruptCheckpointError(
            f"{here}: byte range of {end - begin} bytes does not fit a {list(sizes)} {dtype_name(dtype)} chunk"
        )
    sums = _list(c["checksums"], "the chunk checksums", here)
    if len(sums) != max(1, -(-(end - begin) // block)):
        raise CorruptCheckpointError(f"{here}: {len(sums)} checksums for {end - begin} bytes")
    checksums = tuple(_text(h, "a chunk checksum", here, _DIGEST) for h in sums)
    return Chunk(offsets, sizes, file, key, begin, end, checksums, digest, ref)
