"""Hand-made torch.save files for the importer's hostile-input tests (tests/test_import_hostile.py and
the import fuzz test): the zip format (``archive/data.pkl`` plus one record per storage) and the
legacy format (pickles, then each storage as an int64 element count and its bytes), written from a
description, so that a pickle can declare what its records do not hold while every CRC-32 is right,
or a legacy file can declare sizes it does not have. ``torch.load`` reads the honest ones."""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
PROTOCOL_VERSION = 1001
SYS_INFO = {
    "protocol_version": PROTOCOL_VERSION,
    "little_endian": True,
    "type_sizes": {"short": 2, "int": 4, "long": 4},
}


class Storage:
    """A storage as a pickle refers to it: ``numel`` elements of ``dtype`` under ``key`` (the record
    itself is given separately, so the two may disagree)."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class View:
    """``_rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict())`` when pickled."""

    def __init__(self, storage: Storage, size: tuple[int, ...], stride: tuple[int, ...], offset: int = 0) -> None:
        self.storage, self.size, self.stride, self.offset = storage, size, stride, offset

    def __reduce__(self) -> Any:
        return (
            torch._utils._rebuild_tensor_v2,
            (self.storage, self.offset, torch.Size(self.size), self.stride, False, OrderedDict()),
        )


class Call:
    """Any ``callable(*args)`` when pickled (a global the importer must refuse)."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> Any:
        return (self.fn, self.args)


_STORAGE_TYPES = {
    torch.float32: torch.FloatStorage,
    torch.float64: torch.DoubleStorage,
    torch.int64: torch.LongStorage,
    torch.uint8: torch.ByteStorage,
    torch.bfloat16: torch.BFloat16Storage,
}


def pickled(obj: Any, *, legacy: bool = False) -> bytes:
    """``obj`` pickled as torch.save pickles it (protocol 2), :class:`Storage` objects as persistent ids."""

    class Pickler(pickle.Pickler):
        def persistent_id(self, o: Any) -> Any:
            if isinstance(o, Storage):
                base = ("storage", _STORAGE_TYPES[o.dtype], o.key, "cpu", o.numel)
                return (*base, None) if legacy else base
            return None

    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump(obj)
    return buf.getvalue()


def zip_file(
    path: Path,
    obj: Any,
    records: dict[str, bytes],
    *,
    name: str = "archive",
    compress: dict[str, int] | None = None,
    pkl: bytes | None = None,
) -> Path:
    """A torch.save zip file: ``obj`` as ``data.pkl`` (or the raw ``pkl``), ``records`` as
    ``data/<key>``; every CRC-32 right. ``compress`` deflates the named records."""
    compress = compress or {}
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr(f"{name}/data.pkl", pickled(obj) if pkl is None else pkl)
        z.writestr(f"{name}/byteorder", b"little")
        for key, data in records.items():
            z.writestr(f"{name}/data/{key}", data, compress_type=compress.get(key, zipfile.ZIP_STORED))
        z.writestr(f"{name}/version", b"3\n")
    return path


def bomb(path: Path, nbytes: int) -> Path:
    """A zip file whose one float32 storage record is ``nbytes`` zero bytes deflated to about
    ``nbytes / 1000``: the pickle and the record agree, only the ratio is hostile."""
    s = Storage("0", torch.float32, nbytes // 4)
    obj = {"w": View(s, (nbytes // 4,), (1,))}
    info = zipfile.ZipInfo("archive/data/0")
    info.compress_type = zipfile.ZIP_DEFLATED
    with zipfile.ZipFile(path, "w", compresslevel=1) as z:
        z.writestr("archive/data.pkl", pickled(obj))
        z.writestr("archive/byteorder", b"little")
        with z.open(info, "w", force_zip64=True) as out:
            zero = bytes(1 << 20)
            for _ in range(nbytes >> 20):
                out.write(zero)
        z.writestr("archive/version", b"3\n")
    return path


def legacy_file(
    path: Path,
    obj: Any,
    storages: list[tuple[str, torch.dtype, bytes]],
    *,
    header_numel: dict[str, int] | None = None,
) -> Path:
    """A legacy (non-zip) torch.save file: magic number, protocol version, system info, ``obj``, the
    storage keys, then each storage as its element count (``header_numel`` may lie) and bytes."""
    header_numel = header_numel or {}
    out = io.BytesIO()
    for value in (MAGIC_NUMBER, PROTOCOL_VERSION, SYS_INFO):
        pickle.dump(value, out, protocol=2)
    out.write(pickled(obj, legacy=True))
    pickle.dump([key for key, _, _ in storages], out, protocol=2)
    for key, dtype, data in storages:
        numel = header_numel.get(key, len(data) // dtype.itemsize)
        out.write(struct.pack("<q", numel))
        out.write(data)
    path.write_bytes(out.getvalue())
    return path


def records_of(path: Path) -> list[zipfile.ZipInfo]:
    with zipfile.ZipFile(path) as z:
        return z.infolist()


def data_offset(path: Path, record: str) -> int:
    """Where the bytes of zip record ``record`` (a name ending) begin in the file."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(record))
    raw = path.read_bytes()
    start = info.header_offset
    name_len, extra_len = struct.unpack("<HH", raw[start + 26 : start + 30])
    return start + 30 + name_len + extra_len


def flip(path: Path, offset: int, mask: int = 0x01) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= mask
    path.write_bytes(bytes(raw))


def crc_ok(path: Path) -> bool:
    with zipfile.ZipFile(path) as z:
        return all(zlib.crc32(z.read(i.filename)) == i.CRC for i in z.infolist())
