"""The process-wide registry of asynchronous saves in flight: a new save or a load first waits for
them (:func:`drain`), at most ``SHARDSAFE_MAX_INFLIGHT_SAVES`` run at once, an error nobody waited for
is raised by the next save or load, and interpreter exit finishes them (or says loudly which could
not). Every rank keeps its own registry; nothing here talks to other ranks."""

from __future__ import annotations

import atexit
import logging
import sys
import threading

from shardsafe.engine.save import SaveHandle

logger = logging.getLogger(__name__)

_inflight: list[SaveHandle] = []  # asynchronous saves not yet known to be finished, oldest first
_inflight_lock = threading.Lock()


def add(handle: SaveHandle) -> None:
    """(the saving rank, before its background thread starts) Track ``handle`` until it is seen done."""
    with _inflight_lock:
        _inflight.append(handle)


def drain(allowed: int) -> None:
    """Wait until at most ``allowed`` asynchronous saves are in flight, oldest first; raise the error
    of a finished one that nobody has seen yet (its wait() was never called). Each failure surfaces
    exactly once: at its own ``wait()`` or here, never both and never neither."""
    while True:
        with _inflight_lock:
            finished = [h for h in _inflight if h.done()]
            _inflight[:] = [h for h in _inflight if not h.done()]
            oldest = _inflight[0] if len(_inflight) > allowed else None
        for i, handle in enumerate(finished):
            try:
                _raise_unseen(handle)
            except BaseException:
                with _inflight_lock:  # the others' errors are raised by the next call, not lost
                    _inflight[:0] = finished[i + 1 :]
                raise
        if oldest is None:
            return
        _raise_unseen(oldest)


def _raise_unseen(handle: SaveHandle) -> None:
    """Wait for ``handle``; raise its error unless its owner already saw it. (``wait()`` marks an error
    seen as it raises it, so whether it was seen is read before waiting.)"""
    seen = handle._error_seen
    try:
        handle.wait()  # bounded by that save's own end deadline (plus margins)
    except BaseException:
        if not seen:
            raise
        logger.debug("shardsafe: earlier save of %s had failed (already reported)", handle.path)


@atexit.register
def _flush_at_exit() -> None:
    """Interpreter exit: finish the saves in flight, or say loudly which could not."""
    with _inflight_lock:
        pending = list(_inflight)
    for handle in pending:
        if handle.done() and handle._error_seen:
            continue
        try:
            handle.wait()
        except BaseException as err:
            msg = f"shardsafe: the asynchronous save of {handle.path} did NOT complete at exit: {err}"
            logger.error(msg)
            print(msg, file=sys.stderr, flush=True)
