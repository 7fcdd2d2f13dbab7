"""Filesystem calls under a deadline. A write or fsync on a hung disk or network filesystem never
returns, and nothing can interrupt it; so the save path runs its local writes and fsyncs on a worker
thread and waits for each with the save's deadline. At the deadline the caller raises
``TimeoutError`` (an ``OSError``) naming the path, and the save fails on that rank instead of hanging
it (wrapped into a CheckpointError naming the rank and phase); the stuck thread is a daemon and is left
to the kernel.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import TypeVar

T = TypeVar("T")

_Job = tuple[Callable[[], object], "Future[object]"]


def _expired(what: str, path: str) -> TimeoutError:
    return TimeoutError(
        f"{path}: {what} did not finish within the save's deadline (the filesystem is hung or far too slow). "
        "Check the storage; raise timeout= (or SHARDSAFE_IO_TIMEOUT) if it is merely slow."
    )


class IOThread:
    """One daemon worker thread that runs blocking calls in order, each waited for until ``deadline``
    (``time.monotonic()`` seconds; ``None`` = no deadline, the call runs on the caller's thread)."""

    def __init__(self, path: str, deadline: float | None) -> None:
        self.path = path
        self.deadline = deadline
        self.hung = False
        self._jobs: queue.SimpleQueue[_Job | None] | None = None
        if deadline is not None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(self._jobs,), name="shardsafe-io", daemon=True).start()

    @staticmethod
    def _serve(jobs: queue.SimpleQueue[_Job | None]) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            fn, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as err:  # handed to the waiting caller, which raises it
                future.set_exception(err)

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` and return its result; ``TimeoutError`` naming ``what`` at the deadline."""
        if self._jobs is None or self.deadline is None:
            return fn()
        if self.hung:
            raise _expired(f"{what} (an earlier call is still stuck)", self.path)
        future: Future[object] = Future()
        self._jobs.put((fn, future))
        try:
            return future.result(timeout=max(0.0, self.deadline - time.monotonic()))  # type: ignore[return-value]
        except FuturesTimeout:
            self.hung = True
            raise _expired(what, self.path) from None

    def stop(self) -> None:
        """End the worker once its queue is done (a stuck worker ends when its call returns)."""
        if self._jobs is not None:
            self._jobs.put(None)
            self._jobs = None


def run_bounded(what: str, path: str, deadline: float | None, fn: Callable[[], T]) -> T:
    """``fn()`` on a worker thread, waited for until ``deadline``; see :class:`IOThread`."""
    io = IOThread(path, deadline)
    try:
        return io.call(what, fn)
    finally:
        io.stop()
