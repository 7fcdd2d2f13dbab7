"""Staging for asynchronous saves: this rank's share (only the chunks it writes, after replicated
tensors were deduplicated) is copied into CPU buffers that are allocated once and reused by later
saves with the same chunk boxes (pinned when the source is on an accelerator).

Each save in flight holds one buffer set; a finished save returns its set to a pool the next save
reuses. The API admits at most ``SHARDSAFE_MAX_INFLIGHT_SAVES`` (default 1) saves in flight and the
pool keeps at most that many sets, each trimmed to the chunks of its latest save, so staging memory
stays within that many times this rank's share, and a buffer is never overwritten while a background
write still reads it.
"""

from __future__ import annotations

import threading

import torch

from shardsafe import knobs
from shardsafe.format.datafile import PendingChunk

_Key = tuple[str, tuple[int, ...], tuple[int, ...], torch.dtype]
BufferSet = dict[_Key, torch.Tensor]
_idle: list[BufferSet] = []  # sets no save holds, reused first
_busy: list[BufferSet] = []  # sets of saves in flight
_lock = threading.Lock()


def staged_bytes() -> int:
    """Bytes currently held in staging buffers by this process (idle and in use)."""
    with _lock:
        return sum(b.numel() * b.element_size() for bufs in (*_idle, *_busy) for b in bufs.values())


def release(bufs: BufferSet) -> None:
    """(the save that staged into ``bufs``, once its data is written or abandoned) Return the set."""
    with _lock:
        if any(b is bufs for b in _busy):
            _busy[:] = [b for b in _busy if b is not bufs]
            _idle.append(bufs)
        del _idle[: max(0, len(_idle) + len(_busy) - knobs.max_inflight_saves())]


def stage_chunks(chunks: list[PendingChunk], *, copy: bool) -> tuple[list[PendingChunk], BufferSet | None]:
    """(every rank, caller's thread) Chunks whose ``data`` is a contiguous CPU tensor. Without ``copy``
    the data may still alias the caller's tensors (synchronous save: written before we return); with
    ``copy`` it is a private snapshot in a buffer set the caller must :func:`release`, so the caller
    may change its tensors at once."""
    if not copy:
        return [_plain(c) for c in chunks], None
    with _lock:
        old = _idle.pop() if _idle else {}
    out = []
    bufs: BufferSet = {}
    for c in chunks:
        key = (c.name, c.offsets, c.sizes, c.data.dtype)
        buf = old.get(key)
        if buf is None:
            pin = c.data.device.type != "cpu" and torch.cuda.is_available()
            buf = torch.empty(c.sizes, dtype=c.data.dtype, pin_memory=pin)
        buf.copy_(c.data.reshape(c.sizes), non_blocking=c.data.device.type != "cpu")
        bufs[key] = buf
        out.append(PendingChunk(c.name, c.offsets, c.sizes, buf))
    del old  # buffers no longer planned are freed here
    if any(c.data.device.type == "cuda" for c in chunks):
        torch.cuda.synchronize()
    with _lock:
        _busy.append(bufs)
    return out, bufs


def _plain(c: PendingChunk) -> PendingChunk:
    data = c.data.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    if not data.is_contiguous():
        data = data.contiguous()
    return PendingChunk(c.name, c.offsets, c.sizes, data)
