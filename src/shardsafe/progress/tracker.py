"""Counting, sharing and reporting the progress of one save or load (records: :mod:`shardsafe.progress.record`).

Threads: every rank with peers runs one progress thread per operation that posts its counts at most
every ``SHARDSAFE_PROGRESS_INTERVAL`` seconds (:mod:`shardsafe.progress.keys`); on rank 0 the same
thread gathers the others' counts, logs an INFO line and hands a record to the callback's own thread.
So neither a slow store nor a slow or failing callback holds up a writer, a reader or a wait of the
protocol. A callback that raises is logged (ERROR, with its traceback) and not called again for that
operation; the operation goes on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from shardsafe import knobs
from shardsafe.progress.keys import RankCounts, gather, publish, shared
from shardsafe.progress.record import Progress, ProgressCallback, describe

if TYPE_CHECKING:
    from shardsafe.coord import Operation
    from shardsafe.coord.counters import Counters

logger = logging.getLogger(__name__)


class Tracker:
    """One operation's progress on one rank. Call order (the operation's thread): :meth:`start` right
    after joining, :meth:`set_total` once planned, :meth:`add`/:meth:`counted` while moving bytes (any
    thread), :meth:`own_counts` for the operation's last message (rank 0: :meth:`final` with everyone's),
    :meth:`end` exactly once."""

    def __init__(self, op: str, path: str, callback: ProgressCallback | None) -> None:
        self.op, self.path, self.callback = op, path, callback
        self.started = time.monotonic()
        self.interval = knobs.progress_interval()
        self.phase = "rendezvous"  # set by the operation, or read through ``phase_of``
        self.phase_of: Callable[[], str] | None = None
        self.counters: Counters | None = None  # shared with the other ranks through these
        self.rank, self.world = 0, 1
        self._lock = threading.Lock()
        self._done = self._total = 0
        self._seen: dict[int, RankCounts] = {}  # rank 0: every rank's largest counts seen
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._caller: _Caller | None = None
        self._store_failed = False
        self._logged = False
        self._ended = False
        self._final_gather = False  # rank 0, end of a success without final counts: read every rank once more
        self._finals = False  # rank 0 has every rank's final counts (from the operation's last messages)

    # --------------------------------------------------------------------------- the operation

    def start(self, coord: Operation | None, phase_of: Callable[[], str] | None = None) -> None:
        """(every rank, the operation's thread, once joined; ``coord=None``: one process) Start the
        progress thread (rank 0, and every rank with peers) and, on rank 0, the callback's thread.
        A callback passed on another rank is not called (documented: rank 0 reports for all)."""
        self.phase_of = phase_of
        if coord is not None:
            self.rank, self.world = coord.rank, coord.world_size
        self.counters = shared(coord)
        if self.rank == 0 and self.callback is not None:
            self._caller = _Caller(self, self.callback)
        if self.rank == 0 or self.counters is not None:
            self._thread = threading.Thread(target=self._tick, name=f"shardsafe-progress-{self.op}", daemon=True)
            self._thread.start()

    def set_total(self, total: int) -> None:
        """(this rank, once planned) The bytes this rank will move; posted at once."""
        with self._lock:
            self._total = total
        self._wake.set()

    def add(self, n: int) -> None:
        """(any thread) ``n`` more bytes moved by this rank."""
        with self._lock:
            self._done += n

    def count(self, _offset: int, view: memoryview) -> None:
        """(any thread) A ``deliver`` callback of :func:`~shardsafe.format.datafile.read_blocks`: ``view``
        was read and verified; count it."""
        self.add(len(view))

    def counted(self, windows: Iterable[memoryview], first: int) -> Iterator[memoryview]:
        """``windows`` as they are, counting each once the consumer asks for the next (it has handed
        the previous one to storage), and ``first`` bytes (the file header, written before the first
        window is asked for) at the start."""
        self.add(first)
        for view in windows:
            yield view
            self.add(len(view))

    def own_counts(self) -> list[int]:
        """(this rank, the operation's thread) Its counts now, ``[done, total]``, for the operation's last
        message: rank 0's final record then needs no store request of its own."""
        own = self._own()
        return [own.done, own.total]

    def final(self, counts: dict[int, list[int]]) -> None:
        """(rank 0) Every rank's final counts, as their last messages carried them."""
        with self._lock:
            for r, c in counts.items():
                if len(c) == 2 and all(type(x) is int and x >= 0 for x in c):
                    self._seen[r] = RankCounts(c[0], c[1], "done")
            self._finals = True

    def end(self, error: BaseException | None) -> None:
        """(every rank, the operation's thread, once, when the operation is over; before the
        coordinator is closed) Stop the progress thread. Rank 0 builds the final record (after a
        success, from every rank's flushed counts, read by the progress thread: this thread makes no
        store request here, and waits for that read at most ``SHARDSAFE_PROGRESS_FINAL_WAIT`` seconds),
        logs it if the operation ran past the interval, and hands it to the callback, waiting at most
        ``SHARDSAFE_PROGRESS_FINAL_WAIT`` seconds for the callback to take it."""
        if self._ended:
            return
        self._ended = True
        self._final_gather = error is None and self.rank == 0 and not self._finals
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(knobs.progress_final_wait() if self._final_gather else 1.0)
            if self._thread.is_alive() and self._final_gather:
                logger.warning(
                    "shardsafe: rank 0 could not read the other ranks' final progress of the %s of %s within "
                    "%.0fs (SHARDSAFE_PROGRESS_FINAL_WAIT; the store is slow); the final record has the counts "
                    "seen last",
                    self.op,
                    self.path,
                    knobs.progress_final_wait(),
                )
        if self.rank != 0:
            return
        summary = None if error is None else (f"{type(error).__name__}: {error}".splitlines() or [""])[0][:500]
        record = self._record(finished=True, error=summary)
        if self._logged:
            logger.info("shardsafe: %s", describe(record))
        if self._caller is not None:
            self._caller.offer(record)
            wait = knobs.progress_final_wait()
            if not self._caller.wait_final(wait):
                logger.warning(
                    "shardsafe: the progress callback of the %s of %s has not taken the final record after %.0fs "
                    "(SHARDSAFE_PROGRESS_FINAL_WAIT); the %s returns and the callback gets it from its own thread",
                    self.op,
                    self.path,
                    wait,
                    self.op,
                )

    # ---------------------------------------------------------------------------------- inside

    def _phase(self) -> str:
        return self.phase_of() if self.phase_of is not None else self.phase

    def _own(self) -> RankCounts:
        with self._lock:
            return RankCounts(self._done, self._total, self._phase())

    def _store_trouble(self, err: BaseException) -> None:
        if not self._store_failed:
            self._store_failed = True
            logger.warning(
                "shardsafe: rank %d could not share the progress of the %s of %s through the store (%s: %s); "
                "progress figures stop there, the %s itself goes on (its own waits report a lost store)",
                self.rank,
                self.op,
                self.path,
                type(err).__name__,
                err,
                self.op,
            )

    def _merge_others(self) -> None:
        if self.counters is None or self._store_failed:
            return
        try:
            others = gather(self.counters)
        except Exception as err:
            self._store_trouble(err)
            return
        with self._lock:
            for r, c in others.items():
                old = self._seen.get(r)
                if old is not None:  # a record read late never takes counts back
                    c = RankCounts(max(c.done, old.done), max(c.total, old.total), c.phase)
                self._seen[r] = c

    def _record(self, *, finished: bool = False, error: str | None = None) -> Progress:
        own = self._own()
        with self._lock:
            self._seen[self.rank] = own
            per = [self._seen.get(r) for r in range(self.world)]
        fractions = [0.0 if c is None else 1.0 if c.total == 0 else min(1.0, c.done / c.total) for c in per]
        slowest = min(range(self.world), key=lambda r: fractions[r])
        phase = own.phase if not finished or error else "done"
        return Progress(
            op=self.op,
            path=self.path,
            phase=phase,
            done_bytes=sum(c.done for c in per if c is not None),
            total_bytes=sum(c.total for c in per if c is not None),
            seconds=time.monotonic() - self.started,
            ranks=self.world,
            ranks_reporting=sum(c is not None for c in per),
            slowest_rank=slowest,
            slowest_fraction=fractions[slowest],
            finished=finished,
            error=error,
        )

    def _tick(self) -> None:
        """(the progress thread) Post this rank's counts when they change, at most every interval
        (and at once when its total is known); rank 0 also reports every interval."""
        posted: RankCounts | None = None
        due = self.started + self.interval
        while True:
            wait = max(0.0, due - time.monotonic()) if self.rank == 0 else self.interval
            self._wake.wait(wait)
            self._wake.clear()
            if self._stop.is_set():
                if self._final_gather:
                    self._merge_others()
                return
            try:
                if self.counters is not None and not self._store_failed:
                    own = self._own()
                    if own != posted and time.monotonic() >= self.started + self.interval:
                        try:
                            publish(self.counters, own)
                            posted = own
                        except Exception as err:
                            self._store_trouble(err)
                if self.rank == 0 and time.monotonic() >= due:
                    self._merge_others()
                    record = self._record()
                    if self._stop.is_set():
                        continue  # the operation ended meanwhile: its final record follows
                    self._logged = True
                    logger.info("shardsafe: %s", describe(record))
                    if self._caller is not None:
                        self._caller.offer(record)
                    due = time.monotonic() + self.interval
            except Exception as err:  # a bug here must not end progress silently, nor touch the operation
                logger.error("shardsafe: progress reporting of the %s of %s failed: %s", self.op, self.path, err)
                return


@contextmanager
def tracked(op: str, path: str, callback: ProgressCallback | None, phase: str) -> Iterator[Tracker]:
    """(one process, no rendezvous: verify and export) A started :class:`Tracker` for the ``with`` body,
    in ``phase``; ended with the exception that leaves the body (the final record carries it), or with
    none. The caller checks ``callback`` with :func:`~shardsafe.progress.record.check_callback` first."""
    tracker = Tracker(op, path, callback)
    tracker.phase = phase
    tracker.start(None)
    try:
        yield tracker
    except BaseException as err:
        tracker.end(err)
        raise
    tracker.end(None)


class _Caller:
    """(rank 0) Calls the user's callback on a thread of its own, one record at a time, in order;
    a record that arrives while the callback is busy replaces the one waiting (a slow callback sees
    fewer records, never stale ones, and never holds up the operation). The final record is the last."""

    def __init__(self, tracker: Tracker, callback: ProgressCallback) -> None:
        self.tracker, self.callback = tracker, callback
        self._cond = threading.Condition()
        self._pending: Progress | None = None
        self._closed = False  # the final record was offered, or the callback failed
        self._last_done = 0
        self._final = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"shardsafe-progress-callback-{tracker.op}", daemon=True)
        self._thread.start()

    def offer(self, record: Progress) -> None:
        with self._cond:
            if self._closed or (not record.finished and record.done_bytes < self._last_done):
                return
            self._last_done = record.done_bytes
            self._closed = record.finished
            self._pending = record
            self._cond.notify()

    def wait_final(self, timeout: float) -> bool:
        """Whether the callback took the final record within ``timeout`` seconds; its thread has then
        ended too (it ends right after), so nothing of the operation outlives it."""
        if not self._final.wait(timeout):
            return False
        self._thread.join(timeout)
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None)
                record, self._pending = self._pending, None
            assert record is not None
            try:
                self.callback(record)
            except BaseException as err:  # logged with its traceback; the operation is not affected
                with self._cond:
                    self._closed = True
                logger.error(
                    "shardsafe: the progress callback of the %s of %s raised in phase %r (%s: %s); it is not "
                    "called again for this %s, which goes on regardless. Fix the callback.",
                    self.tracker.op,
                    self.tracker.path,
                    record.phase,
                    type(err).__name__,
                    err,
                    self.tracker.op,
                    exc_info=err,
                )
                self._final.set()
                return
            if record.finished:
                self._final.set()
                return
