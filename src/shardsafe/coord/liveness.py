"""Heartbeats: while in a save or load each rank ticks a store counter from a background thread, on
shardsafe's own store connection (:mod:`shardsafe.coord.connection`), and waiting ranks take a rank
whose counter has stopped for ``SHARDSAFE_DEAD_AFTER`` seconds for dead. A heartbeat that cannot
reach the store is reported (WARNING) and raised by the rank's next wait."""

from __future__ import annotations

import json
import logging
import threading
import time

from torch._C._distributed_c10d import Store

from shardsafe import knobs
from shardsafe.coord.access import StoreAccess
from shardsafe.coord.connection import connection_for
from shardsafe.errors import RankDeadError

logger = logging.getLogger(__name__)


class Liveness(StoreAccess):
    """The heartbeat side of a :class:`~shardsafe.coord.Coordinator` (which sets these attributes)."""

    _hb_stop: threading.Event | None
    _hb_seen: dict[int, tuple[int, float]]
    _hb_checked: float
    _hb_error: BaseException | None
    _finishing: bool
    _shared: Store | None

    def _start_heartbeat(self) -> None:
        self._use("hb")  # tells rank 0's cleanup to wait for every rank's close()
        stop = self._hb_stop = threading.Event()
        key = self._k("hb", str(self.rank))
        self._add(key, 1)
        assert self._shared is not None
        conn = connection_for(self._shared, self.identity)
        fallback = self._store()

        def tick() -> None:
            while not stop.wait(knobs.heartbeat_seconds()):
                # shardsafe's own connection as soon as it is up: never queued behind another thread's
                # blocking get on the shared client
                store = (conn.store() if conn is not None else None) or fallback
                try:
                    store.add(key, 1)
                except Exception as err:  # reported, and raised by this rank's next wait
                    if stop.is_set() or self._finishing:
                        logger.debug("shardsafe: heartbeat of rank %d ended with the store: %s", self.rank, err)
                        return
                    self._hb_error = err
                    logger.warning(
                        "shardsafe: the heartbeat of rank %d in %s of %s stopped: %s: %s. The other ranks will "
                        "take this rank for dead after SHARDSAFE_DEAD_AFTER=%.0fs; this rank's %s raises.",
                        self.rank,
                        self.op,
                        self.target,
                        type(err).__name__,
                        err,
                        knobs.dead_after(),
                        self.op,
                    )
                    return

        threading.Thread(target=tick, name=f"shardsafe-heartbeat-{self.op}", daemon=True).start()

    def _raise_if_heartbeat_failed(self) -> None:
        err = self._hb_error
        if err is not None:
            raise RankDeadError(
                f"{self.op} of {self.target!r}: the heartbeat of rank {self.rank} could not reach the rendezvous "
                f"store ({type(err).__name__}: {err}); the other ranks take this rank for dead. Restart the job, it "
                "resumes from the last committed checkpoint.",
                store_lost=True,
            ) from err

    def _check_alive(self, phase: str, ranks: list[int]) -> None:
        """Raise :class:`RankDeadError` (and abort the operation for all) if one of ``ranks`` joined
        this operation and its heartbeat has stopped for ``SHARDSAFE_DEAD_AFTER`` seconds."""
        if self._hb_stop is None or not ranks:
            return
        now = time.monotonic()
        if now - self._hb_checked < knobs.heartbeat_seconds():
            return
        self._hb_checked = now
        for r in ranks:
            count = self._add(self._k("hb", str(r)), 0)
            if count == 0:
                continue  # never joined this operation: that is the deadline's business
            last = self._hb_seen.get(r)
            if last is None or last[0] != count:
                self._hb_seen[r] = (count, now)
            elif now - last[1] > knobs.dead_after():
                message = (
                    f"{self.op} of {self.target!r}: rank {r} joined but stopped responding {now - last[1]:.0f}s ago "
                    f"in phase {phase!r} (its heartbeat stopped: the process died or is frozen). Nothing was "
                    "committed; restart the job, it resumes from the last committed checkpoint."
                )
                record = {"rank": r, "phase": phase, "error": f"RankDeadError: rank {r} stopped (heartbeat lost)"}
                self._compare_set(self._k("abort"), json.dumps(record))
                raise RankDeadError(message)

    def _dead(self, ranks: list[int]) -> list[int]:
        """Those of ``ranks`` that joined this operation and whose heartbeat has not moved for
        ``SHARDSAFE_DEAD_AFTER`` seconds (checked at most once per heartbeat period)."""
        if self._hb_stop is None or not ranks:
            return []
        now = time.monotonic()
        dead = []
        for r in ranks:
            last = self._hb_seen.get(r)
            if last is not None and now - last[1] < knobs.heartbeat_seconds():
                continue  # seen moving lately: spare the store a request
            count = self._add(self._k("hb", str(r)), 0)
            if count == 0:
                continue
            if last is None or last[0] != count:
                self._hb_seen[r] = (count, now)
            elif now - last[1] > knobs.dead_after():
                dead.append(r)
        return dead
