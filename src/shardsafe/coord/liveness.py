"""Liveness: one watchdog thread per process and store.

While some operation of this process is active, the watchdog ticks this rank's alive counter
(``<namespace>/alive/<rank>``) every ``SHARDSAFE_HEARTBEAT_SECONDS``. A tick the store does not answer
within ``SHARDSAFE_DEAD_AFTER`` means the store is lost (the client fails every request from then on,
and every wait wakes and raises). While a wait of this process depends on other ranks (a
:class:`Watch`), the watchdog also reads their counters (one ``multi_get`` per period, whatever their
number) and, for a rank whose counter has not moved for ``SHARDSAFE_DEAD_AFTER`` seconds, calls the
watch's ``on_dead``: the agreement then proposes an outcome naming that rank dead, so that every rank,
the frozen one too when it wakes, gets the same outcome.

A rank's counter is per process, not per operation, so a watch names only ranks known to be inside the
operation (they arrived); a rank still training elsewhere is the deadline's business."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shardsafe import knobs, workers
from shardsafe.coord.client import StoreClient
from shardsafe.deadline import Deadline
from shardsafe.errors import RankDeadError

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Watch:
    """A wait that depends on ``ranks()`` (read on the watchdog thread, each period). ``on_dead(ranks,
    silent_seconds)`` runs on the watchdog thread, once per rank found dead."""

    ranks: Callable[[], list[int]]
    on_dead: Callable[[list[int], float], None]
    wake: threading.Event = field(default_factory=threading.Event)
    declared: set[int] = field(default_factory=set)


class Watchdog:
    """(per process and store) See the module docstring. Its thread runs only while an operation is
    active: the first :meth:`activate` starts it, the last :meth:`deactivate` stops it and waits for it
    (a bounded time), so no thread of shardsafe outlives the call that started it, nor talks to the store
    after it returned (at interpreter exit such a thread is killed inside native code: the process
    aborts after a save that succeeded)."""

    def __init__(self, client: StoreClient, namespace: str, rank: int) -> None:
        self.client = client
        self.namespace = namespace
        self.rank = rank
        self._lock = threading.Lock()
        self._active = 0
        self._watches: list[Watch] = []
        self._seen: dict[int, tuple[str, float]] = {}  # rank -> (counter, when it last moved)
        self._kick = threading.Event()
        self._stop: threading.Event | None = None  # the running thread's: set to end it
        self._thread: threading.Thread | None = None
        self._warned = False
        workers.on_exit(self._kick.set)

    def key(self, rank: int) -> str:
        return f"{self.namespace}/alive/{rank}"

    def activate(self, deadline: Deadline) -> None:
        """(an operation starting on this process) Tick from now on until the matching
        :meth:`deactivate`. The first tick is posted at once, before the operation's first record, so
        a rank that arrived always has a counter."""
        self.client.reset()
        self.client.post_add(self.key(self.rank), deadline)
        with self._lock:
            self._active += 1
            if self._thread is None:
                stop = self._stop = threading.Event()
                self._thread = workers.start_thread(lambda: self._run(stop), "shardsafe-watchdog")

    def deactivate(self) -> None:
        """(an operation ending) The last one stops the thread and waits until it has ended (at most
        ``SHARDSAFE_ERROR_REPORT_SECONDS``: a tick stuck in a frozen store is left to end on its own,
        and makes no request after it)."""
        with self._lock:
            self._active = max(0, self._active - 1)
            if self._active or self._thread is None:
                return
            thread, stop = self._thread, self._stop
            self._thread = self._stop = None
        assert stop is not None
        stop.set()
        self._kick.set()
        if thread is not threading.current_thread():
            thread.join(knobs.error_report_seconds())

    def watch(self, w: Watch) -> None:
        with self._lock:
            self._watches.append(w)
        self._kick.set()

    def unwatch(self, w: Watch) -> None:
        with self._lock:
            if w in self._watches:
                self._watches.remove(w)

    # ------------------------------------------------------------------------------------ thread

    def _run(self, stop: threading.Event) -> None:
        while True:
            self._kick.wait(knobs.heartbeat_seconds())  # activate() posted the first tick
            self._kick.clear()
            with self._lock:
                watches = list(self._watches)
            if stop.is_set() or workers.exiting():
                return
            try:
                self._tick()
                if watches:
                    self._check(watches, stop)
            except RankDeadError as err:  # the store is lost: every wait of this process raises it, now
                if not self._warned:
                    self._warned = True
                    logger.warning("shardsafe: %s", err)
                for w in watches:
                    w.wake.set()
            except Exception as err:  # never kills the watchdog; the waits raise what the store raises
                logger.debug("shardsafe: watchdog of rank %d: %s: %s", self.rank, type(err).__name__, err)

    def _tick(self) -> None:
        if self.client.lost is not None:  # nothing more to learn from the store until the next operation
            return

        def heartbeat(err: RankDeadError) -> RankDeadError:
            return RankDeadError(
                f"the heartbeat of rank {self.rank} could not reach the rendezvous store ({err}); the other ranks "
                "take this rank for dead. Restart the job; it resumes from the last committed checkpoint.",
                store_lost=True,
            )

        self.client.add(self.key(self.rank), 1, Deadline.after(knobs.dead_after(), "store"), reword=heartbeat)
        self._warned = False

    def _check(self, watches: list[Watch], stop: threading.Event) -> None:
        if stop.is_set():
            return
        wanted = sorted({r for w in watches for r in w.ranks() if r != self.rank})
        if not wanted:
            return
        bound = Deadline.after(knobs.dead_after(), "store")
        keys = [self.key(r) for r in wanted]
        if not self.client.check(keys, bound):
            return  # a rank that never ticked: not inside the operation yet (see the module docstring)
        values = self.client.multi_get(keys, bound)
        now = time.monotonic()
        dead: list[tuple[int, float]] = []
        for r, value in zip(wanted, values, strict=True):
            last = self._seen.get(r)
            if last is None or last[0] != value:
                self._seen[r] = (value, now)
            elif now - last[1] > knobs.dead_after():
                dead.append((r, now - last[1]))
        for w in watches:
            mine = [(r, s) for r, s in dead if r in w.ranks() and r not in w.declared]
            if mine:
                w.declared.update(r for r, _ in mine)
                try:
                    w.on_dead([r for r, _ in mine], max(s for _, s in mine))
                finally:
                    w.wake.set()


_lock = threading.Lock()
_dogs: dict[tuple[int, str, int], Watchdog] = {}


def watchdog_for(client: StoreClient, namespace: str, rank: int) -> Watchdog:
    """The process's watchdog for ``client`` (one per store, namespace and rank)."""
    key = (id(client), namespace, rank)
    with _lock:
        dog = _dogs.get(key)
        if dog is None:
            dog = _dogs[key] = Watchdog(client, namespace, rank)
        return dog
