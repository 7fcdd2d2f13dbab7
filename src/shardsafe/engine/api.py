"""The public functions: save, async_save, load, verify, inspect. A synchronous save is an async save
plus ``wait()`` (run inline, without the staging copy)."""

from __future__ import annotations

import atexit
import logging
import math
import os
import sys
import threading
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from shardsafe import knobs
from shardsafe.coord import Deadlines
from shardsafe.engine import load as _load
from shardsafe.engine.commit import finish_bound
from shardsafe.engine.read import read_manifest
from shardsafe.engine.save import SaveHandle, SaveJob
from shardsafe.format.datafile import read_verified, verify_header
from shardsafe.format.values import decode
from shardsafe.storage import get_storage

logger = logging.getLogger("shardsafe")

_inflight: list[SaveHandle] = []  # asynchronous saves not yet known to be finished, oldest first
_inflight_lock = threading.Lock()

__all__ = [
    "CheckpointInfo",
    "EntryInfo",
    "SaveHandle",
    "VerifySummary",
    "async_save",
    "inspect",
    "load",
    "save",
    "verify",
]


def _drain(deadlines: Deadlines, allowed: int) -> None:
    """Wait until at most ``allowed`` asynchronous saves are in flight, oldest first; raise the error
    of a finished one that nobody has seen yet (its wait() was never called)."""
    while True:
        with _inflight_lock:
            finished = [h for h in _inflight if h.done()]
            _inflight[:] = [h for h in _inflight if not h.done()]
            oldest = _inflight[0] if len(_inflight) > allowed else None
        for handle in finished:
            _raise_unseen(handle, deadlines)
        if oldest is None:
            return
        _raise_unseen(oldest, deadlines)


def _raise_unseen(handle: SaveHandle, deadlines: Deadlines) -> None:
    try:
        handle.wait(finish_bound(deadlines) + 60)
    except BaseException:
        if not handle._reported:
            raise
        logger.debug("shardsafe: earlier save of %s had failed (already reported)", handle.path)


def _start(
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    background: bool,
    overwrite: bool,
    timeout: float | Deadlines | None,
    group: Any,
    metadata: Any,
    allow_pickle: bool,
    storage_options: dict[str, Any] | None,
) -> SaveHandle:
    deadlines = Deadlines.resolve(timeout)
    _drain(deadlines, knobs.max_inflight_saves() - 1)
    job = SaveJob(
        os.fspath(path),
        state,
        overwrite=overwrite,
        deadlines=deadlines,
        group=group,
        metadata=metadata,
        allow_pickle=allow_pickle,
        storage_options=storage_options,
    )
    job.begin(copy=background)
    if not background:
        job.finish()
        return SaveHandle(job, None)
    handle = SaveHandle(job, None)
    thread = threading.Thread(target=handle._run, name=f"shardsafe-save-{job.save_id}", daemon=True)
    handle._thread = thread
    with _inflight_lock:
        _inflight.append(handle)
    thread.start()
    return handle


def save(
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    overwrite: bool = False,
    timeout: float | Deadlines | None = None,
    group: Any = None,
    metadata: Any = None,
    allow_pickle: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """Save ``state`` to ``path`` as one checkpoint, committed all-or-nothing.

    Call it on EVERY rank of the default process group (or of ``group``), or in a single process;
    the library decides which rank writes which bytes. ``state`` maps names to modules (plain, DDP,
    FSDP2), optimizers, objects with ``state_dict()``/``load_state_dict()``, tensors (DTensor too) and
    plain values. Plain tensors and values are taken as identical on every rank.

    When it returns on any rank the checkpoint is durable and visible. Raises
    :class:`CheckpointExistsError` if ``path`` is committed and not ``overwrite`` (an overwrite
    replaces it atomically), :class:`UnsafeValueError` for a value that would need pickle, and on
    every rank a coordination error naming the rank and phase if any rank fails or never arrives.
    ``timeout`` (seconds) bounds every wait; default ``SHARDSAFE_TIMEOUT`` or 300 s for ranks to
    arrive and ``SHARDSAFE_IO_TIMEOUT`` or 1800 s for writes and the commit.
    """
    _start(
        path,
        state,
        background=False,
        overwrite=overwrite,
        timeout=timeout,
        group=group,
        metadata=metadata,
        allow_pickle=allow_pickle,
        storage_options=storage_options,
    )


def async_save(
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    overwrite: bool = False,
    timeout: float | Deadlines | None = None,
    group: Any = None,
    metadata: Any = None,
    allow_pickle: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> SaveHandle:
    """Like :func:`save`, but returns once this rank's share is copied into staging memory; writing
    and commit run in the background. Change the model freely after it returns: the checkpoint holds
    the values at the call. At most ``SHARDSAFE_MAX_INFLIGHT_SAVES`` (default 1) saves are in flight:
    a new save first waits for the oldest. Errors raise from ``handle.wait()`` (and from the next save
    or load if never waited for) on every rank. See docs/async.md."""
    return _start(
        path,
        state,
        background=True,
        overwrite=overwrite,
        timeout=timeout,
        group=group,
        metadata=metadata,
        allow_pickle=allow_pickle,
        storage_options=storage_options,
    )


def load(
    path: str | os.PathLike[str],
    state: MutableMapping[str, Any] | None = None,
    *,
    strict: bool = True,
    timeout: float | Deadlines | None = None,
    group: Any = None,
    allow_pickle: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load the checkpoint at ``path``.

    With ``state`` (every rank calls): modules, optimizers and stateful objects are restored in place,
    tensors are filled in place, other values in ``state`` are replaced; returns the checkpoint's
    entries that ``state`` did not ask for. Any saved world size loads into any current one.
    ``strict=True`` raises :class:`MissingKeysError` before modifying anything if a requested key is
    missing; ``strict=False`` loads what exists and leaves the rest untouched.

    With ``state=None`` (one process, no rendezvous): the whole checkpoint as CPU tensors and values.
    """
    _drain(Deadlines.resolve(timeout), 0)  # a load may read what a save in flight is writing
    return _load.load(
        os.fspath(path),
        state,
        strict=strict,
        deadlines=Deadlines.resolve(timeout),
        group=group,
        allow_pickle=allow_pickle,
        storage_options=storage_options,
    )


@dataclass(frozen=True)
class VerifySummary:
    path: str
    files: int
    tensors: int
    bytes: int


def verify(path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None) -> VerifySummary:
    """Check every byte of the checkpoint at ``path`` against its checksums (one process, no rendezvous).
    Raises :class:`CheckpointNotFoundError` or :class:`CorruptCheckpointError` naming file and tensor."""
    path = os.fspath(path)
    storage = get_storage(path, storage_options)
    manifest = read_manifest(storage, path)
    by_file: dict[str, list[Any]] = {name: [] for name in manifest.files}
    for tname, entry in manifest.tensors.items():
        for c in entry.chunks:
            by_file[c.file].append((tname, c))
    total = 0
    for fname, fentry in manifest.files.items():
        fpath = storage.join(path, fname)
        try:
            verify_header(
                storage,
                fpath,
                fentry,
                [c for _, c in by_file[fname]],
                [manifest.tensors[t].dtype for t, _ in by_file[fname]],
            )
        except (FileNotFoundError, EOFError, ValueError) as err:
            from shardsafe.errors import CorruptCheckpointError

            raise CorruptCheckpointError(f"{fpath}: {type(err).__name__}: {err}") from err
        for tname, c in by_file[fname]:
            buf = bytearray(min(c.end - c.begin, manifest.block_bytes))
            for start in range(0, c.end - c.begin, manifest.block_bytes):
                view = memoryview(buf)[: min(manifest.block_bytes, c.end - c.begin - start)]
                read_verified(storage, fpath, c, manifest.block_bytes, start, view, tname)
            total += c.end - c.begin
        total += fentry.header_bytes
    return VerifySummary(path=path, files=len(manifest.files), tensors=len(manifest.tensors), bytes=total)


@dataclass(frozen=True)
class EntryInfo:
    name: str
    kind: str
    dtype: str | None
    shape: tuple[int, ...] | None
    chunks: int
    nbytes: int


@dataclass(frozen=True)
class CheckpointInfo:
    path: str
    format_version: int
    save_id: str
    created: float
    world_size: int
    strategy: str
    total_bytes: int
    metadata: Any
    files: list[str]
    entries: list[EntryInfo]
    library: dict[str, str]


def inspect(path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None) -> CheckpointInfo:
    """What a committed checkpoint holds, from its manifest alone (no data read)."""
    path = os.fspath(path)
    manifest = read_manifest(get_storage(path, storage_options), path)
    entries = []
    for key, obj in manifest.objects.items():
        entries.append(EntryInfo(key, obj["kind"], None, None, 0, 0))
    for name, t in manifest.tensors.items():
        entries.append(
            EntryInfo(
                name,
                "tensor",
                str(t.dtype).removeprefix("torch."),
                t.shape,
                len(t.chunks),
                math.prod(t.shape) * t.dtype.itemsize,
            )
        )
    return CheckpointInfo(
        path=path,
        format_version=manifest.format_version,
        save_id=manifest.save_id,
        created=manifest.created,
        world_size=manifest.world_size,
        strategy=manifest.strategy,
        total_bytes=manifest.total_bytes,
        metadata=decode(manifest.metadata, "metadata", lambda ref: ref),
        files=sorted(manifest.files),
        entries=entries,
        library=manifest.library,
    )


@atexit.register
def _flush_at_exit() -> None:
    """Interpreter exit: finish the saves in flight, or say loudly which could not."""
    with _inflight_lock:
        pending = list(_inflight)
    for handle in pending:
        if handle.done() and handle._reported:
            continue
        try:
            handle.wait()
        except BaseException as err:
            msg = f"shardsafe: the asynchronous save of {handle.path} did NOT complete at exit: {err}"
            logger.error(msg)
            print(msg, file=sys.stderr, flush=True)
