"""Blocking calls on daemon threads, waited for under a deadline: the one executor of shardsafe.

A write or fsync on a hung disk, a request to a frozen store host or a black-holed object store never
returns, and nothing can interrupt it. So every call that may hang runs here, on a daemon thread, and
the caller waits for it only until its :class:`~shardsafe.deadline.Deadline`: at the deadline the
caller raises (a :class:`~shardsafe.errors.CheckpointTimeoutError` naming what and where, unless the
caller says otherwise) and the stuck thread is left to the kernel. Daemon threads never keep the
process from exiting.

- :class:`Lane`: one thread running calls in order (a data file's writes, a store connection's
  requests). A call still running at its deadline *wedges* the lane: later calls fail at once, and
  the owner opens a new lane if it wants to go on.
- :class:`Pool`: a few threads running independent calls (reads, part uploads).
- :func:`run_bounded`: one call on a thread of its own.

Layer 1: imports :mod:`shardsafe.errors`, :mod:`shardsafe.knobs` and :mod:`shardsafe.deadline`."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from shardsafe import knobs
from shardsafe.deadline import Deadline
from shardsafe.errors import CheckpointTimeoutError

T = TypeVar("T")
logger = logging.getLogger(__name__)

_Job = tuple[Callable[[], Any], "Future[Any] | None"]
_names = itertools.count()


def expired(what: str, where: str, deadline: Deadline) -> CheckpointTimeoutError:
    """The error of a call that did not finish by ``deadline``."""
    return CheckpointTimeoutError(
        f"{where}: {what} did not finish within {deadline.seconds:g}s (the call's {deadline.budget} deadline; the "
        "storage or network is hung or far too slow). Check it; raise timeout= (or SHARDSAFE_IO_TIMEOUT) if it is "
        "merely slow."
    )


def _serve(jobs: queue.SimpleQueue[_Job | None]) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        _run_one(*job)
        del job  # this frame is in the traceback of an error handed over: hold nothing of the call


def _run_one(fn: Callable[[], Any], future: Future[Any] | None) -> None:
    if future is None:  # posted: nobody waits; its poster logs its failures (a later waited call meets them)
        try:
            fn()
        except BaseException as err:
            logger.debug("shardsafe: a posted call failed: %s: %s", type(err).__name__, err)
        return
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn())
    except BaseException as err:  # handed to the waiting caller, which raises it
        future.set_exception(err)
    finally:
        del fn, future  # the error's traceback holds this frame: no cycle back to the future


def wait_for(
    future: Future[T],
    deadline: Deadline,
    *,
    interrupt: Callable[[], None] | None = None,
    wake: threading.Event | None = None,
) -> T | None:
    """(the caller) The result of ``future``, or ``None`` if the deadline passed first. Every
    ``SHARDSAFE_POLL_SECONDS``, and whenever ``wake`` is set, ``interrupt()`` runs and may raise to end
    the wait early (a peer found dead, the store found lost)."""
    if interrupt is None and wake is None:
        try:
            return future.result(timeout=deadline.remaining())
        except TimeoutError:
            return None
    done = threading.Event()

    def finished(_f: Future[T]) -> None:
        done.set()
        if wake is not None:
            wake.set()

    future.add_done_callback(finished)
    event = wake if wake is not None else done
    while not future.done():
        left = deadline.remaining()
        if left <= 0:
            return None
        event.wait(min(left, knobs.poll_seconds()))
        if wake is not None:
            wake.clear()
        if future.done():
            break
        if interrupt is not None:
            interrupt()
    return future.result()


class Lane:
    """One daemon thread that runs calls in order. See the module docstring."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.wedged = False
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=_serve, args=(self._jobs,), name=f"shardsafe-{name}-{next(_names)}", daemon=True
        )
        self._thread.start()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Queue ``fn``; its future."""
        future: Future[T] = Future()
        self._jobs.put((fn, future))
        return future

    def post(self, fn: Callable[[], object]) -> None:
        """Queue ``fn`` and do not wait for it (a request that needs no answer); it runs before any
        call queued after it."""
        self._jobs.put((fn, None))

    def call(
        self,
        what: str,
        where: str,
        fn: Callable[[], T],
        deadline: Deadline,
        *,
        on_expiry: Callable[[], BaseException] | None = None,
        interrupt: Callable[[], None] | None = None,
        wake: threading.Event | None = None,
    ) -> T:
        """Run ``fn`` on the lane and return its result (or raise its error). At ``deadline`` the lane is
        wedged and ``on_expiry()`` (default: :func:`expired`) is raised; see :func:`wait_for` for
        ``interrupt`` and ``wake``."""
        if self.wedged:
            raise (
                on_expiry()
                if on_expiry is not None
                else expired(f"{what} (an earlier call is still stuck)", where, deadline)
            )
        future = self.submit(fn)
        try:
            result = wait_for(future, deadline, interrupt=interrupt, wake=wake)
        except BaseException:
            if not future.done():  # abandoned by an interrupt: its thread may be stuck for good
                self.wedged = True
            raise
        if result is None and not future.done():
            self.wedged = True
            raise on_expiry() if on_expiry is not None else expired(what, where, deadline)
        return future.result()

    def close(self, *, wait: bool = False) -> None:
        """End the thread once its queue is done (a stuck thread ends when its call returns, if ever). With
        ``wait``, and when no call is stuck (the lane is not wedged), return once the thread has ended: the
        caller's call leaves no thread behind it."""
        self._jobs.put(None)
        if wait and not self.wedged and self._thread is not threading.current_thread():
            self._thread.join()


class Pool:
    """``threads`` daemon threads running independent calls, in the order submitted."""

    def __init__(self, threads: int, name: str) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=_serve, args=(self._jobs,), name=f"shardsafe-{name}-{next(_names)}", daemon=True)
            for _ in range(max(1, threads))
        ]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        self._jobs.put(((lambda: fn(*args)), future))
        return future

    def shutdown(self, wait: bool, *, cancel: bool = False) -> None:
        """Let the threads end once the queued calls are done (with ``cancel``, calls not started yet are
        cancelled instead); with ``wait``, wait until they have (the caller knows none is stuck)."""
        if cancel:
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None and job[1] is not None:
                    job[1].cancel()
        for _ in self._threads:
            self._jobs.put(None)
        if wait:
            for t in self._threads:
                t.join()


def run_bounded(what: str, where: str, deadline: Deadline, fn: Callable[[], T]) -> T:
    """``fn()`` on a daemon thread of its own, waited for until ``deadline``; see :class:`Lane`."""
    lane = Lane("call")
    try:
        return lane.call(what, where, fn, deadline)
    finally:
        lane.close(wait=True)  # its one call is over, unless it is stuck (the lane is wedged then)
