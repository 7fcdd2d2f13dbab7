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

**Nothing outlives its call, and exit is clean.** A thread here ends with the call that started it: a
lane's thread when the lane is closed (at once when nothing is queued, see :meth:`Lane.close`), a
pool's when it is shut down. Interpreter exit (:func:`shut_down`, run by the exit hook after the saves
in flight are finished) refuses every new thread and every call not started yet, and waits a bounded
time for the calls still running: a daemon thread that is inside native code (a store request) when
the interpreter finalizes is killed as it returns, and the process aborts ("terminate called without an
active exception") after a save that succeeded.

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
from shardsafe.errors import CheckpointTimeoutError, ClosedError

T = TypeVar("T")
logger = logging.getLogger(__name__)

_Job = tuple[Callable[[], Any], "Future[Any] | None"]
_names = itertools.count()


_exit_lock = threading.Lock()
_exiting = False
_threads: set[threading.Thread] = set()  # started here and not finished
_closers: list[Callable[[], None]] = []  # run by shut_down before it waits (wake or stop a thread)
_open: set[Lane | Pool] = set()  # lanes and pools not stopped yet


def exiting() -> bool:
    """Whether the interpreter is exiting (:func:`shut_down` ran): nothing new may start."""
    return _exiting


def _exiting_error(what: str) -> ClosedError:
    return ClosedError(
        f"shardsafe: {what} refused: the interpreter is exiting (an asynchronous save still running at exit is "
        "reported by the exit hook; wait() for it before the script ends)"
    )


def start_thread(target: Callable[[], object], name: str) -> threading.Thread:
    """Start ``target`` on a daemon thread named ``name``, known to :func:`shut_down`; raise
    :class:`ClosedError` when the interpreter is exiting."""

    def run() -> None:
        try:
            target()
        finally:
            with _exit_lock:
                _threads.discard(thread)

    with _exit_lock:
        if _exiting:
            raise _exiting_error(f"starting {name}")
        thread = threading.Thread(target=run, name=name, daemon=True)
        _threads.add(thread)
    try:
        thread.start()
    except BaseException:
        with _exit_lock:
            _threads.discard(thread)
        raise
    return thread


def on_exit(closer: Callable[[], None]) -> None:
    """Have :func:`shut_down` call ``closer()`` (wake a thread that waits, close a connection's lane)
    before it waits for the threads."""
    with _exit_lock:
        _closers.append(closer)


def shut_down(seconds: float) -> None:
    """(the exit hook, once the saves in flight are finished or given up) From now on no thread starts
    and no queued call runs; the callbacks of :func:`on_exit` run, every lane and pool is closed, and the
    threads still running get ``seconds`` in all to return (a call stuck in a hung store or disk is left
    to its thread, which the interpreter then kills). Idempotent."""
    global _exiting
    with _exit_lock:
        _exiting = True
        closers, _closers[:] = list(_closers), []
        lanes = list(_open)
        running = list(_threads)
    for close in closers:
        try:
            close()
        except Exception as err:  # exit goes on; nothing else can be done with it now
            logger.debug("shardsafe: at exit: %s: %s", type(err).__name__, err)
    for lane in lanes:
        lane.stop()
    deadline = Deadline.after(seconds, "exit")
    for thread in running:
        if thread is not threading.current_thread():
            thread.join(deadline.remaining())
    stuck = [t.name for t in running if t.is_alive()]
    if stuck:
        logger.warning("shardsafe: at exit, these threads were still inside a call after %.0fs: %s", seconds, stuck)


def expired(what: str, where: str, deadline: Deadline) -> CheckpointTimeoutError:
    """The error of a call that did not finish by ``deadline``."""
    return CheckpointTimeoutError(
        f"{where}: {what} did not finish within {deadline.seconds:g}s (the call's {deadline.budget} deadline; the "
        "storage or network is hung or far too slow). Check it; raise timeout= (or SHARDSAFE_IO_TIMEOUT) if it is "
        "merely slow."
    )


def _serve(jobs: queue.SimpleQueue[_Job | None], done: Callable[[_Job], None] | None = None) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        if _exiting:  # a call not started by now never starts (see the module docstring)
            if job[1] is not None and job[1].set_running_or_notify_cancel():
                job[1].set_exception(_exiting_error("a call queued at exit"))
        else:
            _run_one(*job)
        if done is not None:
            done(job)
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
        self._lock = threading.Lock()
        self._posted = 0  # posted calls not finished yet
        self._stopped = False
        self._thread = start_thread(lambda: _serve(self._jobs, self._finished), f"shardsafe-{name}-{next(_names)}")
        with _exit_lock:
            _open.add(self)

    def _finished(self, job: _Job) -> None:
        if job[1] is None:
            with self._lock:
                self._posted -= 1

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Queue ``fn``; its future."""
        future: Future[T] = Future()
        self._jobs.put((fn, future))
        return future

    def post(self, fn: Callable[[], object]) -> None:
        """Queue ``fn`` and do not wait for it (a request that needs no answer); it runs before any
        call queued after it."""
        with self._lock:
            self._posted += 1
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

    def stop(self) -> None:
        """Let the thread end once the calls queued so far are done. Idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        with _exit_lock:
            _open.discard(self)
        self._jobs.put(None)

    def close(self, drain: Deadline | None = None) -> None:
        """End the thread once its queue is done, and wait for it: with ``drain``, until the posted calls
        still queued are done (at most until ``drain``); without, only when none is (every call queued
        has returned to its caller, so the thread only has to see the end). A wedged lane is not waited
        for: its thread ends when its stuck call returns, if ever."""
        self.stop()
        if self.wedged or self._thread is threading.current_thread():
            return
        if drain is not None:
            self._thread.join(drain.remaining())
        elif self._posted == 0:
            self._thread.join(knobs.error_report_seconds())


class Pool:
    """``threads`` daemon threads running independent calls, in the order submitted."""

    def __init__(self, threads: int, name: str) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._stopped = False
        self._threads: list[threading.Thread] = []
        try:
            for _ in range(max(1, threads)):
                self._threads.append(start_thread(lambda: _serve(self._jobs), f"shardsafe-{name}-{next(_names)}"))
        except BaseException:
            self.stop()
            raise
        with _exit_lock:
            _open.add(self)

    def stop(self) -> None:
        """Let the threads end once the calls queued so far are done. Idempotent."""
        with _exit_lock:
            if self._stopped:
                return
            self._stopped = True
            _open.discard(self)
        for _ in self._threads:
            self._jobs.put(None)

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
        self.stop()
        if wait:
            for t in self._threads:
                t.join()


def run_bounded(what: str, where: str, deadline: Deadline, fn: Callable[[], T]) -> T:
    """``fn()`` on a daemon thread of its own, waited for until ``deadline``; see :class:`Lane`."""
    lane = Lane("call")
    try:
        return lane.call(what, where, fn, deadline)
    finally:
        lane.close()
