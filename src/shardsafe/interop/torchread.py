"""Reading a ``torch.save`` file (or one item of a DCP folder, which is one) as hostile input.

``torch.load`` trusts the sizes a file declares: it allocates what a legacy file's pickle says before
reading, reads a storage past the end of its zip record (with ``mmap``), inflates a deflated record to
whatever size it claims, materialises stride-0 views, and checks no CRC. This reader does the same job
with every size checked against the bytes that are there first:

- zip format: the archive's directory is checked (one top folder, no duplicate or overlapping records,
  stored or deflated only, nothing encrypted) and every record is read, its size bounded, and checked
  against its CRC-32 before its bytes are used; a storage must fill its record exactly;
- legacy format: every storage a pickle declares must fit in what is left of the file before it is
  allocated, and the element count written before its bytes must match;
- the pickles are read by :mod:`shardsafe.interop.unpickle` (weights-only unless ``allow_pickle``);
- what the file would expand to is bounded (:func:`bound`): records after inflating, and the tensors
  as they would be written (a view repeats bytes of its storage; each is written whole).

Every failure is a :class:`CheckpointError`: :class:`CorruptCheckpointError` naming the file and the
record for damage, :class:`UnsafeValueError` only for an intact file that needs full unpickling.
"""

from __future__ import annotations

import io
import os
import stat
import struct
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from shardsafe.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    MissingPackageError,
    UnsafePathError,
    UnsafeValueError,
    UnsupportedCheckpointError,
)
from shardsafe.format.datafile import tensor_bytes
from shardsafe.format.values import MAX_DEPTH
from shardsafe.interop import unpickle
from shardsafe.interop.unpickle import _Malformed, _Refused

FACTOR, SLACK = 2, 64 << 20
BOUND_TEXT = "2 x the source's size + 64 MiB"
"""What a source may expand to: tied weights and views of one storage write its bytes more than once."""
MAGIC_NUMBER = 0x1950A86A20F9469CFC6C  # the legacy format's first pickle
LEGACY_PROTOCOL = 1001
_CHUNK = 8 << 20


def bound(size: int) -> int:
    """Bytes a source of ``size`` bytes may expand to (:data:`BOUND_TEXT`)."""
    return FACTOR * size + SLACK


@dataclass(frozen=True)
class Source:
    """Bytes ``[start, start + length)`` of the open regular file ``fd``, named ``where`` in messages."""

    fd: int
    start: int
    length: int
    where: str

    def pread(self, n: int, offset: int) -> bytes:
        if offset < 0 or offset + n > self.length:
            raise _Malformed(f"a read of {n} bytes at {offset} passes the end ({self.length} bytes)")
        out = bytearray()
        while len(out) < n:
            got = os.pread(self.fd, n - len(out), self.start + offset + len(out))
            if not got:
                raise _Malformed(f"the file ends at byte {offset + len(out)}, before the {n} bytes it declares")
            out += got
        return bytes(out)

    def pread_into(self, view: memoryview, offset: int) -> None:
        """Fill ``view`` with the bytes at ``offset`` (straight from the file, no copy in between)."""
        if offset < 0 or offset + len(view) > self.length:
            raise _Malformed(f"a read of {len(view)} bytes at {offset} passes the end ({self.length} bytes)")
        done = 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], self.start + offset + done)
            if not got:
                raise _Malformed(f"the file ends at byte {offset + done}, before the {len(view)} bytes it declares")
            done += got


class _Window(io.RawIOBase):
    """A :class:`Source` as a read-only, seekable raw file (for :mod:`zipfile` and the pickles)."""

    def __init__(self, src: Source) -> None:
        self.src, self.pos = src, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.src.length}[whence]
        if base + offset < 0:
            raise _Malformed("a seek before the start of the file")
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        n = max(0, min(len(view), self.src.length - self.pos))
        got = os.preadv(self.src.fd, [view[:n]], self.src.start + self.pos) if n else 0
        self.pos += got
        return got


def open_regular(path: str, what: str) -> int:
    """An fd for reading ``path``, which must be a regular file: opened without blocking, so that a FIFO
    or a device is refused rather than waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        kind = CheckpointNotFoundError if isinstance(err, FileNotFoundError) else UnsafePathError
        raise kind(f"{path}: cannot open the {what} ({err.strerror or err})") from err
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UnsafePathError(
                f"{path}: the {what} is not a regular file ({_kind(mode)}): refused, nothing was read. An import "
                "reads regular files only"
            )
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "a socket or device" if not stat.S_ISLNK(mode) else "a symbolic link"


def sniff(src: Source) -> str:
    """``zip``, ``legacy``, ``safetensors``, ``tar`` (torch < 0.4) or ``unknown``, from the first bytes."""
    head = src.pread(min(src.length, 16), 0)
    if head[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
        return "zip"
    if head[:1] == b"\x80" and head[1:2] and head[1] <= 5:
        return "legacy"
    if len(head) >= 9 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] <= src.length - 8:
        return "safetensors"
    if src.length >= 262 and src.pread(5, 257) == b"ustar":
        return "tar"
    return "unknown"


def read(src: Source, allow_pickle: bool) -> Any:
    """The object the torch.save bytes of ``src`` hold (tensors on the CPU, their bytes in memory),
    checked as the module docstring says."""
    kind = sniff(src)
    if kind == "tar":
        raise UnsupportedCheckpointError(
            f"{src.where}: a torch.save file in the tar format of torch < 0.4, which shardsafe does not import; "
            "load it with that torch and save it again"
        )
    if kind not in ("zip", "legacy"):
        head = src.pread(min(src.length, 8), 0)
        raise CorruptCheckpointError(
            f"{src.where}: not a torch.save file (it starts with {head.hex() or 'nothing'}; a torch.save file is a "
            "zip archive or, from torch < 1.6, a pickle): damaged, cut, or another format"
        )
    try:
        obj, pickled = _zip(src, allow_pickle) if kind == "zip" else _legacy(src, allow_pickle)
    except ImportError as err:  # full unpickling named a module this Python lacks: not damage
        raise MissingPackageError(
            f"{src.where}: reading it needs the module {err.name or str(err)[:100]!r}, which this Python cannot "
            f"import ({type(err).__name__}: {str(err)[:200]}). Install the package that provides it and import "
            "again; nothing was imported"
        ) from err
    except _Malformed as err:
        raise CorruptCheckpointError(
            f"{src.where}: {err}; the file is damaged (or crafted): nothing was imported"
        ) from err
    except _Unsafe as err:
        raise UnsafeValueError(
            f"{src.where}: refused: weights-only reading cannot read it ({err}). If it is a torch.save file from "
            "an author you trust, allow_pickle=True (--allow-pickle) reads it with full unpickling, which runs code "
            "chosen by whoever wrote the file"
        ) from None
    check_tree(obj, src.where, bound(src.length), pickled)
    return obj


# ------------------------------------------------------------------------------- zip format


def _zip(src: Source, allow_pickle: bool) -> tuple[Any, int]:
    try:
        with zipfile.ZipFile(_Window(src)) as archive:
            infos = archive.infolist()
            directory = archive.start_dir
            records = _records(src, archive, infos, directory)
    except (_Malformed, CheckpointError, ImportError):  # a module this Python lacks is no damage
        raise
    except Exception as err:  # what zipfile raises for a damaged directory or header
        raise _Malformed(f"not a readable zip archive ({type(err).__name__}: {str(err)[:200]})") from err
    pkl = records.pop("data.pkl", None)
    if pkl is None:
        raise _Malformed("the archive has no data.pkl record")
    order = records.pop("byteorder", None)
    big = order is not None and bytes(tensor_bytes(order)) == b"big"
    if order is not None and bytes(tensor_bytes(order)) not in (b"little", b"big"):
        raise _Malformed("record 'byteorder' is neither 'little' nor 'big'")
    storages: dict[str, torch.UntypedStorage] = {}

    def persistent_load(pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and _text(pid[0]) == "storage"):
            raise _Malformed(f"data.pkl refers to {_short(pid)}, not to a storage")
        dtype, key, numel = unpickle.storage_dtype(pid[1]), _text(pid[2]), pid[4]
        name = f"data/{key}"
        if name not in records:
            raise _Malformed(f"data.pkl refers to record {name!r}, which the archive lacks")
        if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
            raise _Malformed(f"data.pkl gives record {name!r} {numel!r} elements")
        record = records[name]
        if numel * dtype.itemsize != record.numel():
            raise _Malformed(
                f"record {name!r} holds {record.numel()} bytes, but data.pkl declares {numel} {dtype} elements "
                f"({numel * dtype.itemsize} bytes) for it"
            )
        if key not in storages:
            storages[key] = record.untyped_storage()
            if big:
                storages[key].byteswap(dtype)  # type: ignore[no-untyped-call]
        return _typed(storages[key], dtype)

    return _unpickle(bytes(tensor_bytes(pkl)), persistent_load, allow_pickle, "data.pkl"), pkl.numel()


def _records(
    src: Source, archive: zipfile.ZipFile, infos: list[zipfile.ZipInfo], directory: int
) -> dict[str, torch.Tensor]:
    """Every record's bytes by its name under the archive's top folder, each checked against its CRC-32."""
    if not infos:
        raise _Malformed("the archive holds no records")
    prefix = infos[0].filename.split("/", 1)[0]
    names: set[str] = set()
    for info in infos:
        top, _, rest = info.filename.partition("/")
        if top != prefix or not rest:
            raise _Malformed(f"record {info.filename[:80]!r} is not under the archive's folder {prefix[:80]!r}")
        if rest in names:
            raise _Malformed(f"record {info.filename[:80]!r} appears twice")
        names.add(rest)
        if info.flag_bits & 0x1:
            raise _Malformed(f"record {info.filename[:80]!r} is encrypted")
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise _Malformed(f"record {info.filename[:80]!r} is compressed with method {info.compress_type}")
        if info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size:
            raise _Malformed(f"record {info.filename[:80]!r} is stored, yet its two sizes differ")
    ends = sorted((i.header_offset, i.header_offset + 30 + i.compress_size, i.filename) for i in infos)
    for (_, end, name), (start, _, _) in zip(ends, [*ends[1:], (directory, 0, "")], strict=True):
        if end > start:
            raise _Malformed(f"record {name[:80]!r} overlaps what follows it in the file")
    expanded = sum(i.file_size for i in infos)
    if expanded > bound(src.length):
        big = max(infos, key=lambda i: i.file_size)
        raise _Malformed(
            f"its records declare {expanded} bytes in all (record {big.filename[:80]!r}: {big.file_size} bytes, "
            f"{big.compress_size} in the file), more than the importer's bound of {BOUND_TEXT} "
            f"({bound(src.length)} bytes)"
        )
    return {info.filename.partition("/")[2]: _record(src, archive, info) for info in infos}


def _record(src: Source, archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> torch.Tensor:
    memory, out = fixed(info.file_size)
    view = memoryview(memory)
    crc = 0
    if info.compress_type == zipfile.ZIP_STORED:
        local = src.pread(30, info.header_offset)
        if local[:4] != b"PK\x03\x04":
            raise _Malformed(f"record {info.filename[:80]!r} has no local header where the directory says")
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        begin = info.header_offset + 30 + name_len + extra_len
        encoding = "utf-8" if info.flag_bits & 0x800 else "cp437"
        if src.pread(name_len, info.header_offset + 30) != info.orig_filename.encode(encoding):
            raise _Malformed(f"record {info.filename[:80]!r} has another name in its local header")
        for lo in range(0, info.file_size, _CHUNK):
            hi = min(lo + _CHUNK, info.file_size)
            src.pread_into(view[lo:hi], begin + lo)
            crc = zlib.crc32(view[lo:hi], crc)
    else:
        with archive.open(info) as stream:
            pos = 0
            while pos < info.file_size:
                data = stream.read(min(_CHUNK, info.file_size - pos))
                if not data:
                    raise _Malformed(f"record {info.filename[:80]!r} inflates to fewer bytes than it declares")
                view[pos : pos + len(data)] = data
                crc = zlib.crc32(data, crc)
                pos += len(data)
    if crc != info.CRC:
        raise CorruptCheckpointError(
            f"{src.where}: zip record {info.filename[:200]!r} fails its CRC-32 check (recorded {info.CRC:08x}, "
            f"computed {crc:08x}): the file is damaged; nothing was imported"
        )
    return out


# ------------------------------------------------------------------------------- legacy format


def _legacy(src: Source, allow_pickle: bool) -> tuple[Any, int]:
    f = io.BufferedReader(_Window(src), buffer_size=1 << 16)
    if _unpickle_at(f, _no_storages, False, "the magic number") != MAGIC_NUMBER:
        raise _Malformed("its first pickle is not torch.save's magic number")
    if _unpickle_at(f, _no_storages, False, "the protocol version") != LEGACY_PROTOCOL:
        raise _Malformed("its protocol version is not 1001")
    info = _unpickle_at(f, _no_storages, False, "the system info")
    if not isinstance(info, dict) or info.get("little_endian", True) is not True:
        raise _Malformed("its system info is not a dict saying little-endian (big-endian legacy files are not read)")
    start = f.tell()
    declared: dict[str, tuple[int, bytearray, torch.UntypedStorage]] = {}  # key -> (elements, memory, storage)
    views: dict[str, torch.UntypedStorage] = {}
    room = [0]  # bytes the declared storages take in the file, with their 8-byte counts

    def persistent_load(pid: Any) -> Any:
        if allow_pickle and isinstance(pid, tuple) and len(pid) == 4 and _text(pid[0]) == "module":
            return pid[1]  # a whole module pickled by an old torch.save: its class
        if not (isinstance(pid, tuple) and len(pid) == 6 and _text(pid[0]) == "storage"):
            raise _Malformed(f"the pickle refers to {_short(pid)}, not to a storage")
        dtype, key, numel, view_of = unpickle.storage_dtype(pid[1]), _text(pid[2]), pid[4], pid[5]
        if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
            raise _Malformed(f"storage {key!r} declares {numel!r} elements")
        if key not in declared:
            room[0] += numel * dtype.itemsize + 8
            left = src.length - f.tell()
            if room[0] > left:
                raise _Malformed(
                    f"storage {key!r} declares {numel} {dtype} elements ({numel * dtype.itemsize} bytes): with the "
                    f"others, more than the {left} bytes left in the file"
                )
            memory, tensor = fixed(numel * dtype.itemsize)
            declared[key] = (numel, memory, tensor.untyped_storage())
        storage = declared[key][2]
        if storage.nbytes() != numel * dtype.itemsize:
            raise _Malformed(f"storage {key!r} is declared with two sizes")
        if view_of is not None:
            if not (isinstance(view_of, tuple) and len(view_of) == 3 and all(isinstance(x, int) for x in view_of[1:])):
                raise _Malformed(f"storage {key!r} has a malformed view")
            name, offset, size = _text(view_of[0]), view_of[1], view_of[2]
            if offset < 0 or size < 0 or offset + size > numel:
                raise _Malformed(f"view {name!r} of storage {key!r} does not fit in it")
            views.setdefault(name, storage[offset * dtype.itemsize : (offset + size) * dtype.itemsize])
            storage = views[name]
        return _typed(storage, dtype)

    obj = _unpickle_at(f, persistent_load, allow_pickle, "the data pickle")
    pickled = f.tell() - start
    keys = _unpickle_at(f, _no_storages, False, "the storage keys")
    if not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)) or sorted(keys) != sorted(declared):
        raise _Malformed("its list of storage keys does not match the storages its pickle declares")
    for key in keys:
        numel, memory, storage = declared[key]
        (count,) = struct.unpack("<q", _exactly(f, 8, key))
        if count != numel:
            raise _Malformed(f"storage {key!r} has {count} elements in the file, {numel} in its pickle")
        if storage.nbytes() and f.readinto(memoryview(memory)[: storage.nbytes()]) != storage.nbytes():
            raise _Malformed(f"the file ends inside storage {key!r}")
    if f.read(1):
        raise _Malformed(f"{src.length - f.tell() + 1} bytes follow the last storage")
    return obj, pickled


def fixed(nbytes: int) -> tuple[bytearray, torch.Tensor]:
    """``nbytes`` zero bytes, and a uint8 tensor over them whose storage cannot grow: a pickle read with
    full unpickling runs torch's own rebuilds, and ``set_`` enlarges a storage that is too small for the
    view it is asked for (gigabytes, from a file of a few hundred bytes). Here it raises instead."""
    memory = bytearray(max(nbytes, 1))  # torch.frombuffer refuses an empty buffer: a slice of one byte
    tensor = torch.frombuffer(memory, dtype=torch.uint8)
    return memory, tensor if nbytes else torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage()[0:0])


def _typed(storage: torch.UntypedStorage, dtype: torch.dtype) -> torch.storage.TypedStorage:
    return torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)  # type: ignore[no-untyped-call]


def _exactly(f: Any, n: int, key: str) -> bytes:
    data: bytes = f.read(n)
    if len(data) != n:
        raise _Malformed(f"the file ends before storage {key!r}")
    return data


def _no_storages(pid: Any) -> Any:
    raise _Malformed("a storage where none belongs")


def _unpickle_at(f: Any, persistent_load: unpickle.PersistentLoad, allow_pickle: bool, what: str) -> Any:
    start = f.tell()
    try:
        load = unpickle.load_full if allow_pickle else unpickle.load_restricted
        return load(f, persistent_load)
    except _Refused as why:
        # No checksum covers a legacy file: a flipped byte can turn a name into another. Only a pickle
        # whose structure holds and whose global really exists is taken as asking for full unpickling.
        f.seek(start)
        if why.name is None or not unpickle.well_formed(f):
            raise _Malformed(f"{what}: a damaged pickle ({why})") from None
        if not unpickle.exists(why.name):
            if unpickle.installed(why.name):  # the package is here, the name is not: a damaged name
                raise _Malformed(f"{what} names the global {why.name}, which does not exist here") from None
            raise _Unsafe(what, why, missing=why.name.split(".", 1)[0]) from None
        raise _Unsafe(what, why) from None
    except _Malformed as err:
        raise _Malformed(f"{what}: {err}") from err


def _unpickle(data: bytes, persistent_load: unpickle.PersistentLoad, allow_pickle: bool, what: str) -> Any:
    try:
        load = unpickle.load_full if allow_pickle else unpickle.load_restricted
        return load(io.BytesIO(data), persistent_load)
    except _Refused as why:
        if unpickle.well_formed(io.BytesIO(data), len(data)):
            raise _Unsafe(what, why) from None
        raise _Malformed(f"{what}: a damaged pickle") from None
    except _Malformed as err:
        raise _Malformed(f"{what}: {err}") from err


class _Unsafe(Exception):
    """An intact pickle that asks for more than weights-only reading does (``missing``: the package of that
    global, when it is not installed here)."""

    def __init__(self, what: str, why: _Refused, missing: str | None = None) -> None:
        note = f", from the package {missing}, which is not installed here" if missing else ""
        super().__init__(f"{what} asks for {why}{note}")


# ------------------------------------------------------------------------------- what it expands to


def check_tree(obj: Any, where: str, limit: int, pickled: int) -> None:
    """Refuse what cannot be imported: a value that holds itself, nests deeper than the format allows,
    expands (through shared references) to many more values than its ``pickled`` bytes could describe,
    or holds tensors that are not plain CPU tensors; and tensors that would take more than ``limit``
    bytes to write."""
    total = 0
    for path, t in _walk(obj, where, pickled // 2 + 100_000):
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type != "cpu" or t.layout != torch.strided:
            raise UnsupportedCheckpointError(
                f"{where}: {path!r} is a {type(t).__name__} ({t.layout}, on {t.device}), which shardsafe does not "
                "import; save plain dense tensors"
            )
        nbytes = t.numel() * t.element_size()
        total += nbytes
        if total > limit:
            held = t.untyped_storage().nbytes()
            raise CorruptCheckpointError(
                f"{where}: tensor {path!r} ({list(t.shape)} {t.dtype}, strides {list(t.stride())}) takes {nbytes} "
                f"bytes to write from {held} bytes of storage; with the tensors before it that passes the importer's "
                f"bound of {BOUND_TEXT} ({limit} bytes): refused, nothing was imported. A view that repeats its "
                "storage (stride 0, overlapping strides) is written whole"
            )


def _walk(obj: Any, where: str, most: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) of every tensor in ``obj``'s containers, depth first; checks nesting, cycles and
    that the tree expands to at most ``most`` values."""
    visits = 0
    on_path: set[int] = set()
    todo: list[tuple[Any, str, int, bool]] = [(obj, "", 0, False)]
    while todo:
        value, path, depth, leaving = todo.pop()
        if leaving:
            on_path.discard(id(value))
            continue
        visits += 1
        if visits > most:
            raise CorruptCheckpointError(
                f"{where}: its values expand to more than {most} (shared references repeated through the tree), "
                "more than such a file can hold: refused"
            )
        if isinstance(value, torch.Tensor):
            yield path, value
            continue
        children = _children(value)
        if children is None:
            continue
        if id(value) in on_path:
            raise UnsupportedCheckpointError(
                f"{where}: {path or 'its top level'!r} holds itself (a cycle): it cannot be stored"
            )
        if depth >= MAX_DEPTH:
            raise UnsupportedCheckpointError(
                f"{where}: {path[:200]!r} nests more than {MAX_DEPTH} levels deep, which the format cannot store"
            )
        on_path.add(id(value))
        todo.append((value, path, depth, True))
        for key, child in reversed(children):
            todo.append((child, f"{path}/{key}" if path else str(key), depth + 1, False))


def _children(value: Any) -> list[tuple[Any, Any]] | None:
    if isinstance(value, dict):
        return list(value.items())
    if isinstance(value, (list, tuple, set, frozenset)):
        return list(enumerate(value))
    return None


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if not isinstance(value, str):
        raise _Malformed(f"{_short(value)} where a name belongs")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 80 else text[:77] + "..."
