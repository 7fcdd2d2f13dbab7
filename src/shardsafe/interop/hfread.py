"""Reading a Hugging Face safetensors export (what ``save_pretrained`` writes: ``model.safetensors``, or
shards listed by ``model.safetensors.index.json``; or one ``.safetensors`` file) as hostile input.

A safetensors file is an 8-byte header length, a JSON header (name -> dtype, shape, byte range) and the
tensors' bytes. The header is checked whole before anything is read: its length fits the file, it is
one JSON object without duplicate names, every dtype is one shardsafe stores, every byte range holds
exactly its shape's bytes and the ranges tile the data without a hole or an overlap (as the format
requires). Only regular files inside the folder are read, each named by the index with a plain name.
The format carries no checksum: damage inside tensor bytes cannot be seen (the import then verifies
what it wrote, as every save does).

``save_pretrained`` leaves tied weights out (GPT-2's ``lm_head.weight``); when the folder's
``config.json`` declares them (interop/ties.py, which needs ``transformers``), they are put back as
the same tensor, so that the import loads strictly into the model it came from (for a lone
``model.safetensors`` file too, from the ``config.json`` beside it).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import struct
from typing import Any

import torch

from shardsafe.errors import CorruptCheckpointError
from shardsafe.format.datafile import tensor_bytes
from shardsafe.format.model import SAFETENSORS_DTYPES
from shardsafe.interop.torchread import Source, open_regular

logger = logging.getLogger(__name__)

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
MAX_HEADER = 100_000_000
MAX_JSON = 64 << 20
_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
_SHARD = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,200}\.safetensors")


def is_folder(path: str) -> bool:
    """Whether the folder ``path`` looks like a Hugging Face export (its weights file or index)."""
    return any(os.path.lexists(os.path.join(path, name)) for name in (SINGLE, INDEX))


def read_folder(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the export in ``path``, by name, in the files' order; tied weights put back."""
    if os.path.lexists(os.path.join(path, INDEX)):
        index = _json(os.path.join(path, INDEX), "index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not (isinstance(weight_map, dict) and weight_map and all(isinstance(v, str) for v in weight_map.values())):
            raise CorruptCheckpointError(f"{os.path.join(path, INDEX)}: no 'weight_map' of tensor names to files")
        files = list(dict.fromkeys(weight_map.values()))
        bad = [f for f in files if not _SHARD.fullmatch(f) or ".." in f]
        if bad:
            raise CorruptCheckpointError(
                f"{os.path.join(path, INDEX)}: shard names that are not plain names: {bad[:3]}"
            )
    else:
        weight_map, files = None, [SINGLE]
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        file = os.path.join(path, name)
        got = read_file(file)
        for key in got:
            if key in tensors:
                raise CorruptCheckpointError(f"{file}: tensor {key!r} is in two files")
            if weight_map is not None and weight_map.get(key) != name:
                raise CorruptCheckpointError(
                    f"{file}: holds tensor {key!r}, which the index places in {weight_map.get(key)!r}"
                )
        tensors.update(got)
    if weight_map is not None and set(weight_map) != set(tensors):
        missing = sorted(set(weight_map) - set(tensors))[:5]
        raise CorruptCheckpointError(f"{os.path.join(path, INDEX)}: lists tensors no shard holds: {missing}")
    untie(path, tensors)
    return tensors


def read_file(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file ``path`` (a regular file), checked as the module says."""
    fd = open_regular(path, "safetensors file")
    try:
        size = os.fstat(fd).st_size
        return read(Source(fd, 0, size, path))
    finally:
        os.close(fd)


def read(src: Source) -> dict[str, torch.Tensor]:
    where = src.where
    if src.length < 8:
        raise CorruptCheckpointError(f"{where}: a safetensors file of {src.length} bytes has no header")
    (n,) = struct.unpack("<Q", src.pread(8, 0))
    if n > min(src.length - 8, MAX_HEADER):
        raise CorruptCheckpointError(
            f"{where}: the safetensors header declares {n} bytes, more than the file's {src.length - 8}: damaged or cut"
        )
    header = _parse(src.pread(n, 8), where)
    data = src.length - 8 - n
    spans = []
    for name, info in header.items():
        dtype, shape, begin, end = _entry(name, info, where, data)
        spans.append((begin, end, name, dtype, shape))
    covered = 0
    for begin, end, name, _, _ in sorted(spans):
        if begin != covered:
            what = "overlaps the one before it" if begin < covered else f"leaves a hole of {begin - covered} bytes"
            raise CorruptCheckpointError(f"{where}: safetensors tensor {name!r} {what}: damaged")
        covered = end
    if covered != data:
        raise CorruptCheckpointError(
            f"{where}: the safetensors header accounts for {covered} bytes of data, the file holds {data}: damaged "
            "or cut"
        )
    out: dict[str, torch.Tensor] = {}
    for begin, end, name, dtype, shape in spans:
        buf = torch.empty(end - begin, dtype=torch.uint8)
        if end > begin:
            src.pread_into(tensor_bytes(buf), 8 + n + begin)
        out[name] = buf.view(dtype).reshape(shape) if buf.numel() else torch.empty(shape, dtype=dtype)
    return out


def _parse(raw: bytes, where: str) -> dict[str, Any]:
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(items)
        if len(out) != len(items):
            raise CorruptCheckpointError(f"{where}: a name appears twice in the safetensors header: damaged")
        return out

    def constant(name: str) -> Any:
        raise CorruptCheckpointError(f"{where}: the safetensors header holds {name}, which is not JSON: damaged")

    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=pairs, parse_constant=constant)
    except (ValueError, RecursionError) as err:
        raise CorruptCheckpointError(f"{where}: the safetensors header is not valid JSON ({err}): damaged") from err
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{where}: the safetensors header is not a JSON object: damaged")
    meta = doc.pop("__metadata__", {})
    if not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise CorruptCheckpointError(f"{where}: the safetensors '__metadata__' is not a map of text: damaged")
    return doc


def _entry(name: str, info: Any, where: str, data: int) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    if not name or not (isinstance(info, dict) and set(info) == {"dtype", "shape", "data_offsets"}):
        raise CorruptCheckpointError(f"{where}: safetensors entry {name[:80]!r} is not dtype, shape, data_offsets")
    dtype = _DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
    shape, offsets = info["shape"], info["data_offsets"]
    if dtype is None:
        raise CorruptCheckpointError(f"{where}: safetensors tensor {name[:80]!r} has dtype {info['dtype']!r}")
    if not (isinstance(shape, list) and len(shape) <= 64 and all(_count(v) for v in shape)):
        raise CorruptCheckpointError(f"{where}: safetensors tensor {name[:80]!r} has shape {str(shape)[:80]}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_count(v) for v in offsets)):
        raise CorruptCheckpointError(f"{where}: safetensors tensor {name[:80]!r} has offsets {str(offsets)[:80]}")
    begin, end = offsets
    if not begin <= end <= data or end - begin != math.prod(shape) * dtype.itemsize:
        raise CorruptCheckpointError(
            f"{where}: safetensors tensor {name[:80]!r} ({shape} {dtype}) does not fit bytes [{begin}, {end}) of the "
            f"{data} the file holds: damaged or cut"
        )
    return dtype, tuple(shape), begin, end


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**62


def _json(path: str, what: str) -> Any:
    fd = open_regular(path, what)
    try:
        size = os.fstat(fd).st_size
        if size > MAX_JSON:
            raise CorruptCheckpointError(f"{path}: a {what} of {size} bytes is not what save_pretrained writes")
        raw = Source(fd, 0, size, path).pread(size, 0)
    finally:
        os.close(fd)
    try:
        return json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as err:
        raise CorruptCheckpointError(f"{path}: the {what} is not valid JSON ({err})") from err


def untie(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """Put back the tied weights ``save_pretrained`` left out, as the tensors they are tied to, when the
    folder ``path`` holds a ``config.json`` that declares them."""
    if not os.path.lexists(os.path.join(path, CONFIG)):
        return
    from shardsafe.interop.ties import declared_ties

    config = _json(os.path.join(path, CONFIG), "config")
    ties = declared_ties(config) if isinstance(config, dict) else None
    for name, source in (ties or {}).items():
        if name not in tensors and source in tensors:
            tensors[name] = tensors[source]
            logger.info("shardsafe import: %s is tied to %s (config.json): imported as the same tensor", name, source)
