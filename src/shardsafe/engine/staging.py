"""Staging for asynchronous saves: this rank's share (only the chunks it writes, after replicated
tensors were deduplicated) is copied into CPU buffers that are allocated once and reused by later
saves with the same chunk boxes (pinned when the source is on an accelerator). Buffers no longer
planned are dropped, so staging memory never exceeds this rank's share of the latest save.

At most one save is in flight per process (the API waits for the previous save before staging),
so a buffer is never overwritten while a background write still reads it.
"""

from __future__ import annotations

import threading

import torch

from shardsafe.format.datafile import PendingChunk

_Key = tuple[str, tuple[int, ...], tuple[int, ...], torch.dtype]
_buffers: dict[_Key, torch.Tensor] = {}
_lock = threading.Lock()


def staged_bytes() -> int:
    """Bytes currently held in staging buffers by this process."""
    with _lock:
        return sum(b.numel() * b.element_size() for b in _buffers.values())


def stage_chunks(chunks: list[PendingChunk], *, copy: bool) -> list[PendingChunk]:
    """(every rank, caller's thread) Chunks whose ``data`` is a contiguous CPU tensor. Without ``copy``
    the data may still alias the caller's tensors (synchronous save: written before we return); with
    ``copy`` it is a private snapshot, so the caller may change its tensors at once."""
    if not copy:
        return [_plain(c) for c in chunks]
    out = []
    with _lock:
        keep: dict[_Key, torch.Tensor] = {}
        for c in chunks:
            key = (c.name, c.offsets, c.sizes, c.data.dtype)
            buf = _buffers.get(key)
            if buf is None:
                pin = c.data.device.type != "cpu" and torch.cuda.is_available()
                buf = torch.empty(c.sizes, dtype=c.data.dtype, pin_memory=pin)
            buf.copy_(c.data.reshape(c.sizes), non_blocking=c.data.device.type != "cpu")
            keep[key] = buf
            out.append(PendingChunk(c.name, c.offsets, c.sizes, buf))
        _buffers.clear()
        _buffers.update(keep)
    if any(c.data.device.type == "cuda" for c in chunks):
        torch.cuda.synchronize()
    return out


def _plain(c: PendingChunk) -> PendingChunk:
    data = c.data.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    if not data.is_contiguous():
        data = data.contiguous()
    return PendingChunk(c.name, c.offsets, c.sizes, data)
