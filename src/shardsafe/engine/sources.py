"""The state's tensors as a background save's call found them (:mod:`shardsafe.engine.snapshot`), and
the checks made of them before their memory is read and after their copy.

A :data:`Record` is taken at the call for every tensor background staging copies later: the tensor,
its version counter (``tensor._version``, shared by views and ``detach()``; an in-place operation moves
it), its data pointer, and, for a CPU tensor, its first bytes (at most :data:`HEAD`: the first element
of a strided view; the one read of its memory at the call). Before its memory is read,
:func:`same_memory` says whether it still lies where the call found it (a freed or replaced storage
does not: reading it would crash the process); after its copy, the version and the first bytes say
whether it was written in between (the first bytes catch the writes that move no version counter:
through ``.data``, a numpy view, a BatchNorm forward on statistics held outside their module, when they
change those bytes).
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from shardsafe.format.values import PerRank
from shardsafe.state.flatten import Filtered

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]

StorageKey = tuple[str, int | None, int]
Record = tuple[torch.Tensor, int, int, int, int]
"""A tensor of the save as the call found it: the tensor, its version, its data pointer, and its first
bytes as a width (0: none read) and their value (:func:`first_bytes`)."""

HEAD = 8
"""Bytes of each CPU tensor read at the call (its first element only, for a strided view)."""

_WORDS = {1: ctypes.c_uint8, 2: ctypes.c_uint16, 4: ctypes.c_uint32, 8: ctypes.c_uint64}


def first_bytes(address: int, width: int) -> int:
    """The ``width`` bytes (1, 2, 4 or 8) at ``address`` as an integer: one load, a few times cheaper
    than copying them out as ``bytes``."""
    return int(_WORDS[width].from_address(address).value)


def storage_key(t: torch.Tensor) -> StorageKey | None:
    """Which memory ``t`` lives in (a DTensor: its local shard's), to match chunks with the tensors an
    optimizer or a module owns; ``None`` for tensors without memory."""
    if DTensor is not None and isinstance(t, DTensor):
        t = t._local_tensor
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return (t.device.type, t.device.index, ptr) if ptr else None


def version_of(t: torch.Tensor) -> int | None:
    """``t``'s version counter; ``None`` where it has none (inference tensors)."""
    try:
        return int(t._version)
    except RuntimeError:
        return None


def record(t: torch.Tensor, version: int) -> Record:
    """(the call) ``t`` as it is now: version, data pointer and, for a CPU tensor with memory, its first
    bytes (the one read of its memory at the call: well under a microsecond)."""
    try:
        ptr = t.data_ptr()
    except RuntimeError:  # no plain memory (sparse and the like): the copy refuses it by name
        return (t, version, 0, 0, 0)
    if not ptr or not t.is_cpu:
        return (t, version, ptr, 0, 0)
    size = t.element_size()
    n = t.nbytes
    if not n or ptr == t.storage_offset() * size:  # empty, or its storage was freed (no memory at all)
        return (t, version, ptr, 0, 0)
    if not t.is_contiguous():
        n = size  # its first element is at ``ptr``; the bytes after it may belong to others
    width = HEAD if n >= HEAD else 4 if n >= 4 else 2 if n >= 2 else 1
    return (t, version, ptr, width, first_bytes(ptr, width))


def optimizers_of(state: Mapping[str, Any]) -> list[tuple[str, torch.optim.Optimizer]]:
    """The optimizers of ``state`` by key (also inside ``Filtered`` and ``per_rank``)."""
    out = []
    for key, entry in state.items():
        obj = entry.obj if isinstance(entry, Filtered) else entry
        obj = obj.value if isinstance(obj, PerRank) else obj
        if isinstance(obj, torch.optim.Optimizer):
            out.append((key, obj))
    return out


def optimizer_keys(opt: torch.optim.Optimizer) -> set[StorageKey]:
    """The storages a step of ``opt`` may write: its parameters, its state, its tensor hyper-parameters
    (a tensor learning rate that a scheduler fills in place)."""
    keys: set[StorageKey | None] = set()
    for group in opt.param_groups:
        keys.update(storage_key(p) for p in group["params"])
        keys.update(storage_key(v) for v in group.values() if isinstance(v, torch.Tensor))
    for st in opt.state.values():
        if isinstance(st, Mapping):
            keys.update(storage_key(v) for v in st.values() if isinstance(v, torch.Tensor))
    return {k for k in keys if k is not None}


def same_memory(t: torch.Tensor, ptr: int) -> bool:
    """Whether ``t`` still starts at ``ptr`` (its data pointer at the call) and its storage still holds it."""
    try:
        if t.data_ptr() != ptr:
            return False
        st = t.untyped_storage()
        return bool(st.data_ptr()) and (t.storage_offset() + 1) * t.element_size() <= st.nbytes()
    except RuntimeError:
        return False


def expected(data: torch.Tensor, records: Sequence[Record]) -> tuple[int, int, int]:
    """(the plan) For a chunk whose bytes are ``data`` (a tensor of the state, or rows of one), made from
    the tensors ``records``: its data pointer at the call (0: unknown), and the first bytes its copy must
    start with (those recorded, when the chunk starts where its tensor does), as width and value."""
    for t, _, ptr, width, head in records:
        if t is data:
            return ptr, width, head
    for t, _, ptr, width, head in records:  # rows of one (a replicated tensor split between ranks): a view
        try:
            delta = data.data_ptr() - t.data_ptr()
            same = data.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
        except RuntimeError:
            continue
        if ptr and same and delta >= 0:
            return (ptr + delta, width, head) if delta == 0 else (ptr + delta, 0, 0)
    return 0, 0, 0
