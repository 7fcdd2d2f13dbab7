"""The public functions: save, async_save, load, and (from :mod:`shardsafe.engine.inspect`) verify and
inspect. A synchronous save is an async save plus ``wait()`` (run inline, without the staging copy).
The saves in flight and the exit hook that flushes them live in :mod:`shardsafe.engine.inflight`."""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

from shardsafe import knobs
from shardsafe.coord import Deadlines
from shardsafe.engine import inflight, sidefiles
from shardsafe.engine import load as _load
from shardsafe.engine.guard import entry_point, mapped_errors
from shardsafe.engine.inspect import CheckpointInfo, EntryInfo, VerifySummary, inspect, read_file, verify
from shardsafe.engine.options import SaveOptions, complete, spelled_out
from shardsafe.engine.save import SaveHandle, SaveJob
from shardsafe.progress.record import Progress, ProgressCallback, check_callback
from shardsafe.state.rest import Rest, check_rest
from shardsafe.storage import get_storage

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # pragma: no cover
    from typing_extensions import Unpack

logger = logging.getLogger(__name__)

__all__ = [
    "CheckpointInfo",
    "EntryInfo",
    "Progress",
    "SaveHandle",
    "SaveOptions",
    "VerifySummary",
    "async_save",
    "inspect",
    "load",
    "read_file",
    "save",
    "verify",
]


def _start(path: str | os.PathLike[str], state: Mapping[str, Any], call: str, given: Mapping[str, Any]) -> SaveHandle:
    options = complete(call, given)
    options["progress"] = check_callback(options["progress"])
    options["files"] = sidefiles.check_files(options["files"], options["write_files"], call)
    deadlines = Deadlines.resolve(options["timeout"])
    inflight.drain(knobs.max_inflight_saves() - 1)
    background = call == "async_save"
    job = SaveJob(os.fspath(path), state, options, deadlines.start())
    job.begin(copy=background, defer=background and options["staging"] == "background")
    if not background:
        job.finish()
        return SaveHandle(job, None)
    name = f"shardsafe-save-{os.path.basename(job.path.rstrip('/'))}"
    handle = SaveHandle(job, None)
    handle._thread = threading.Thread(target=handle._run, name=name, daemon=True)
    inflight.add(handle)
    handle.launch()
    return handle


@entry_point("save", reads=False)
@spelled_out
def save(path: str | os.PathLike[str], state: Mapping[str, Any], **options: Unpack[SaveOptions]) -> None:
    """Save ``state`` to ``path`` as one checkpoint, committed all-or-nothing.

    Call it on EVERY rank of the default process group (or of ``group``), or in a single process;
    the library decides which rank writes which bytes. ``state`` maps names to modules (plain, DDP,
    FSDP2), optimizers, objects with ``state_dict()``/``load_state_dict()``, tensors (DTensor too) and
    plain values. Plain tensors and values are taken as identical on every rank; tensors that are not
    sharded but differ between ranks (a model without DDP) make the save fail on every rank, naming
    them (``SHARDSAFE_REPLICA_CHECK``, docs/faults.md).

    When it returns on any rank the checkpoint is durable and visible. Raises
    :class:`CheckpointExistsError` if ``path`` is committed and not ``overwrite`` (an overwrite
    replaces it atomically), :class:`UnsafeValueError` for a value that would need pickle, and on
    every rank a coordination error naming the rank and phase if any rank fails or never arrives.

    Keyword options (:class:`SaveOptions`; a misspelt one raises ``TypeError``):
    ``overwrite`` (default False) replace a committed checkpoint at ``path``, atomically.
    ``timeout`` (seconds, or a :class:`~shardsafe.coord.Deadlines`) bounds every wait; default
    ``SHARDSAFE_TIMEOUT`` or 300 s for ranks to arrive and ``SHARDSAFE_IO_TIMEOUT`` or 1800 s for
    writes and the commit. ``group``: the process group whose ranks save (default: the default group).
    ``metadata``: a JSON-like value stored with the checkpoint (``inspect(path).metadata``).
    ``allow_pickle`` (default False): let values that only pickle can hold be saved (loading them needs
    ``allow_pickle=True`` too). ``storage_options``: passed to fsspec for remote paths (``s3://``...).

    ``base``: an incremental save (docs/incremental.md). The path of a committed checkpoint in the same
    folder as ``path``; chunks whose bytes equal the same tensor's same box in ``base`` (compared by
    content hash) are not written again, the new manifest refers to ``base``'s files instead, so
    ``base`` must stay beside ``path`` for as long as ``path`` is used. Rank 0's ``base`` applies; it may
    be a callable that rank 0 calls when the save starts to choose it (``None``: a full save), as the
    checkpoint manager does: what it raises fails the save on every rank.
    ``progress``: a callable that rank 0 calls with a :class:`Progress` record (all ranks' bytes
    written so far, gathered through the store) at least every ``SHARDSAFE_PROGRESS_INTERVAL`` seconds
    (default 2) and once at the end, from a thread of its own; ignored on other ranks. A callback that
    raises is logged and not called again; the save goes on. See docs/progress.md.
    ``staging``: when :func:`async_save` copies the tensors (``"blocking"`` or ``"background"``); a
    synchronous save copies nothing ahead, and only checks the value.
    ``files``: side files, ``{name: bytes}`` (e.g. ``{"trainer_state.json": b"..."}``), written by rank 0 into
    the checkpoint's folder under those names and committed with it; ``write_files``: a callable that rank 0
    calls with a local folder of its own, whose plain files are committed the same way (for code that writes
    files by path). Rank 0's are the checkpoint's; another rank may give a name in ``files`` only with rank 0's
    bytes. Names are plain (no ``/``, not hidden, not the format's own). :func:`read_file` reads one back,
    verified. A save with side files over a committed checkpoint is refused (save to a new path). See
    docs/huggingface.md, "Side files".
    """
    _start(path, state, "save", options)


@entry_point("async_save", reads=False)
@spelled_out
def async_save(path: str | os.PathLike[str], state: Mapping[str, Any], **options: Unpack[SaveOptions]) -> SaveHandle:
    """Like :func:`save`, but returns once this rank's share is copied into staging memory; writing
    and commit run in the background. Change the model freely after it returns: the checkpoint holds
    the values at the call.

    ``staging="background"`` returns before copying: the copies run on the save's thread while training
    goes on, an optimizer of ``state`` waits in its next ``step()`` until its tensors are copied,
    module buffers are copied at the call, and a tensor changed in place before its copy fails the save
    on every rank with :class:`TornSnapshotError` (never a torn checkpoint). ``handle.staged()`` /
    ``handle.wait_staged()`` tell when the copies are over. Default ``"blocking"``; ``save()`` ignores it.
    At most ``SHARDSAFE_MAX_INFLIGHT_SAVES`` (default 1) saves are in flight:
    a new save first waits for the oldest. Errors raise from ``handle.wait()`` (and from the next save
    or load if never waited for) on every rank. ``base`` and ``progress`` as for :func:`save`; progress
    calls go on after this returns, from a background thread, until the final one. See docs/async.md."""
    return _start(path, state, "async_save", options)


@entry_point("load", reads=True)
def load(
    path: str | os.PathLike[str],
    state: MutableMapping[str, Any] | None = None,
    *,
    strict: bool = True,
    timeout: float | Deadlines | None = None,
    group: Any = None,
    allow_pickle: bool = False,
    storage_options: dict[str, Any] | None = None,
    cast: bool = False,
    device: str | torch.device | None = None,
    progress: ProgressCallback | None = None,
    rest: Rest = "values",
) -> dict[str, Any]:
    """Load the checkpoint at ``path``.

    With ``state`` (every rank calls): loads in place, as torch.distributed.checkpoint does. Tensors
    found in ``state`` (in dicts, lists, tuples, state dicts; a DTensor's local shard) are filled in
    place, keeping their object, storage, device and dtype, so ``{"model": model.state_dict()}``
    loads the model; modules, optimizers and objects with ``state_dict()``/``load_state_dict()`` are
    restored through their own ``load_state_dict``; other values are replaced in their containers.
    Any saved world size loads into any current one; values saved per rank come back to the same rank
    (docs/loading.md).

    Reads only what ``state`` asks for, plus the unrequested entries ``rest`` names, which it returns
    (a dict): ``"values"`` (default, as Fabric's remainder) the small ones, entries that are not modules
    or optimizers and hold at most 1 MiB of tensors (plain values, counters, RNG states); ``"all"``
    every one, read whole (tensors on CPU or ``device``); ``"none"`` none (as DCP). The others stay on
    disk, unread: indexing one in the returned dict raises :class:`MissingKeysError` saying so.

    All or nothing before any data is read: a key missing under ``strict=True``
    (:class:`MissingKeysError`), a shape mismatch, a dtype mismatch (unless ``cast=True``, which
    converts to the destination's dtype) or a damaged manifest raises on every rank, and no rank's
    state has changed. ``strict=False`` loads what exists and leaves the rest untouched.

    With ``state=None`` (one process, no rendezvous): the whole checkpoint, tensors on CPU (or on
    ``device``), per-rank values as ``{rank: value}``; ``rest`` does not apply.

    Every failure is a :class:`CheckpointError` (a damaged or hostile checkpoint: a
    :class:`CorruptCheckpointError` naming the file and tensor), raised in bounded time and memory;
    anything unforeseen is mapped to one with the original as its ``__cause__``. Usage errors (a bad
    ``timeout``, ``storage_options`` or ``rest``) raise ``ValueError``/``TypeError`` as usual.

    ``progress``: as for :func:`save`, with the bytes read and verified by all ranks.
    """
    progress = check_callback(progress)
    rest = check_rest(rest)
    deadlines = Deadlines.resolve(timeout)
    path = os.fspath(path)
    get_storage(path, storage_options)  # usage errors are the caller's, raised as they are
    inflight.drain(0)  # a load may read what a save in flight is writing
    with mapped_errors("load", path):
        return _load.load(
            path,
            state,
            strict=strict,
            clock=deadlines.start(),
            group=group,
            allow_pickle=allow_pickle,
            storage_options=storage_options,
            cast=cast,
            device=None if device is None else torch.device(device),
            progress=progress,
            rest=rest,
        )
