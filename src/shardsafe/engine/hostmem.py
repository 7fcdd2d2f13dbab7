"""Host memory and accelerator streams for the I/O pipelines (saves: :mod:`staging`; loads: :mod:`read`).

A :class:`HostBuffer` is one host allocation of exactly the bytes asked for. When it serves an
accelerator it is page-locked in place with ``cudaHostRegister`` (not the caching pinned allocator,
which rounds every allocation up to a power of two), so copies to and from the device are
asynchronous DMA. The bytes held (and pinned) are counted, with a high-water mark, for the tests and
the benchmarks.

CUDA work is ordered per source device and stream: :func:`after_current` records an event on the
caller's current stream of a device and makes a side stream wait for it; nothing here synchronises a
whole device, let alone "the current device" on behalf of another. Every function that touches CUDA is
only called for tensors whose device type is ``cuda``, so CPU runs never initialise it.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from shardsafe.format.datafile import tensor_bytes

logger = logging.getLogger(__name__)

_cuda: Any = torch.cuda  # typed loosely: parts of its API are untyped in some builds
_lock = threading.Lock()
_held = 0  # bytes of live HostBuffers
_pinned = 0  # of which page-locked
_peak = 0  # high-water mark of _held since reset_peak()
_pinned_peak = 0  # and of _pinned
_count = 0  # HostBuffers ever allocated
_streams: dict[tuple[str, int, str], Any] = {}  # (device type, index, purpose) -> side stream


def _account(nbytes: int, pinned: bool) -> None:
    global _held, _pinned, _peak, _pinned_peak, _count
    with _lock:
        _held += nbytes
        _pinned += nbytes if pinned else 0
        if nbytes > 0:
            _peak = max(_peak, _held)
            _pinned_peak = max(_pinned_peak, _pinned)
            _count += 1


def held_bytes() -> int:
    """Host bytes held by live pipeline buffers of this process (staging pool, slabs, bounce buffers)."""
    return _held


def pinned_bytes() -> int:
    """Of :func:`held_bytes`, those page-locked for an accelerator."""
    return _pinned


def peak_bytes() -> int:
    """High-water mark of :func:`held_bytes` since the last :func:`reset_peak`."""
    return _peak


def pinned_peak_bytes() -> int:
    """High-water mark of :func:`pinned_bytes` since the last :func:`reset_peak`."""
    return _pinned_peak


def reset_peak() -> None:
    global _peak, _pinned_peak
    with _lock:
        _peak, _pinned_peak = _held, _pinned


def allocations() -> int:
    """How many host buffers this process has allocated (each one allocation, pinned or not)."""
    return _count


def _unregister(ptr: int) -> None:
    err = int(_cuda.cudart().cudaHostUnregister(ptr))
    if err != 0:
        logger.error("shardsafe: cudaHostUnregister failed with CUDA error %d (host memory stays locked)", err)


def _release(tensor: torch.Tensor, nbytes: int, registered: bool) -> None:
    if registered:
        _unregister(tensor.data_ptr())
    _account(-nbytes, registered)


class HostBuffer:
    """``nbytes`` of host memory as a flat ``uint8`` tensor, page-locked when ``pinned`` (and CUDA is
    there). Whoever enqueues asynchronous copies into or out of it must wait for them before it is
    closed or dropped: unlocking memory under a DMA in flight is undefined."""

    def __init__(self, nbytes: int, *, pinned: bool) -> None:
        self.nbytes = nbytes
        self.tensor = torch.empty(nbytes, dtype=torch.uint8)
        self.pinned = False
        if pinned and nbytes > 0 and torch.cuda.is_available():
            self.tensor.fill_(0)  # fault the pages in on every intra-op thread before locking them
            try:
                err: int | str = int(_cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 1))  # portable
            except (AttributeError, RuntimeError) as exc:  # a build without the runtime binding
                err = f"{type(exc).__name__}: {exc}"
            if err == 0:
                self.pinned = True
            else:  # still correct (copies become synchronous), only slower: say so once per buffer
                logger.warning(
                    "shardsafe: could not page-lock %.1f MiB of host memory (%s); device copies will be "
                    "synchronous. Check the memory-lock limit (ulimit -l) or lower SHARDSAFE_STAGING_POOL_BYTES",
                    nbytes / 2**20,
                    f"CUDA error {err}" if isinstance(err, int) else err,
                )
        _account(nbytes, self.pinned)
        self._finalizer = weakref.finalize(self, _release, self.tensor, nbytes, self.pinned)

    def view(self, start: int, stop: int) -> torch.Tensor:
        return self.tensor[start:stop]

    def memory(self, start: int, stop: int) -> memoryview:
        """The bytes ``[start, stop)`` as a writable memoryview (no copy)."""
        if stop <= start:
            return memoryview(bytearray())
        return tensor_bytes(self.tensor[start:stop])

    def close(self) -> None:
        self._finalizer()


# ------------------------------------------------------------------------------------ reading memory


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_readv: Any = None  # process_vm_readv, once looked up; False where this process may not use it


def _process_vm_readv() -> Any:
    global _readv
    if _readv is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
            fn.restype = ctypes.c_ssize_t
            ulong, ptr = ctypes.c_ulong, ctypes.c_void_p
            fn.argtypes = [ctypes.c_int, ptr, ulong, ptr, ulong, ulong]  # pid, local, n, remote, n, flags
            _readv = fn
        except (OSError, AttributeError):  # not Linux, or a libc without it
            _readv = False
    return _readv


def read_memory(dst: int, src: int, nbytes: int) -> bool:
    """Copy ``nbytes`` from the address ``src`` to ``dst`` of this process without faulting: ``False``
    when ``src`` stops being readable memory part way (freed by another thread under the copy), where a
    ``memmove`` would kill the process with SIGSEGV. Through ``process_vm_readv`` on this process (the
    kernel copies, and reports an unmapped page as EFAULT); where that is refused (a seccomp profile, no
    such call), through ``memmove``. Releases the GIL while copying."""
    global _readv
    fn = _process_vm_readv()
    done = 0
    while fn and done < nbytes:
        local = _IoVec(dst + done, nbytes - done)
        remote = _IoVec(src + done, nbytes - done)
        got = fn(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got > 0:
            done += got
            continue
        err = ctypes.get_errno()
        if got == 0 or err == errno.EFAULT:
            return False
        if err != errno.EINTR:  # EPERM, ENOSYS: not allowed here; the plain copy is all there is
            _readv = fn = False
            logger.debug("shardsafe: process_vm_readv unavailable (%s); copying with memmove", os.strerror(err))
    if done < nbytes:
        ctypes.memmove(dst + done, src + done, nbytes - done)
    return True


# ------------------------------------------------------------------------------------ CUDA streams


def side_stream(device: torch.device, purpose: str) -> Any:
    """A dedicated stream of ``device`` for the pipeline's copies (one per device and direction, created
    once), so copies never queue behind, nor hold up, the compute stream."""
    key = (device.type, _index(device), purpose)
    with _lock:
        stream = _streams.get(key)
        if stream is None:
            stream = _streams[key] = _cuda.Stream(device=torch.device(device.type, _index(device)))
        return stream


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def mark_current(device: torch.device) -> Any:
    """(the caller's thread) An event marking the work queued so far on the caller's current stream of
    ``device`` (the stream that produced, or still uses, the tensors), for a side stream to wait on
    later, maybe from another thread (:func:`after_mark`)."""
    event = _cuda.Event()
    event.record(torch.cuda.current_stream(torch.device(device.type, _index(device))))
    return event


def current_after(marks: Mapping[tuple[str, int], Any]) -> None:
    """(a thread other than the one that recorded ``marks``, from :func:`mark_current`) Order the work
    this thread queues on its current stream of each device after that device's mark, so that what it
    reads there is what the marking thread had written by then."""
    for (kind, index), mark in marks.items():
        torch.cuda.current_stream(torch.device(kind, index)).wait_event(mark)


def device_key(device: torch.device) -> tuple[str, int]:
    """``device`` with its index filled in (``cuda`` is the current device), to match devices by."""
    return (device.type, _index(device))


def after_current(device: torch.device, stream: Any, mark: Any = None) -> None:
    """Make ``stream`` wait for ``mark`` (from :func:`mark_current`) or, without one, for the work
    queued so far on the caller's current stream of ``device``."""
    stream.wait_event(mark if mark is not None else mark_current(device))


def record(stream: Any) -> Any:
    """An event marking the work queued so far on ``stream``. Waiting for it blocks the thread rather
    than spinning, so waiting reader and writer threads leave the cores to those hashing."""
    event = _cuda.Event(blocking=True)
    event.record(stream)
    return event


def current_waits_for(device: torch.device, stream: Any) -> None:
    """(the caller's thread) Make the caller's current stream of ``device`` wait for ``stream``'s work
    so far (e.g. the copies that filled its tensors)."""
    torch.cuda.current_stream(torch.device(device.type, _index(device))).wait_event(record(stream))
