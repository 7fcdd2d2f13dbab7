"""The outcome of an operation: one decision per operation (the first ``compare_set`` on its decision
key wins), values one rank posts for the others, and the acknowledgement with which rank 0 waits,
before returning, until every live rank has read the outcome."""

from __future__ import annotations

import logging

from shardsafe import knobs
from shardsafe.coord.liveness import Liveness
from shardsafe.coord.waiting import wait_until
from shardsafe.errors import RankDeadError

logger = logging.getLogger(__name__)


class Outcome(Liveness):
    """Decision, posted values and acknowledgement of a :class:`~shardsafe.coord.Coordinator`."""

    _local_decision: str | None

    def decide(self, value: str) -> str:
        """(any rank) Propose ``value`` as the operation's outcome; return the outcome, which is the
        first value ever proposed (one ``compare_set`` on the decision key): once decided, nobody can
        change it. A save proposes ``"commit"`` (rank 0, before publishing) or an abort record (a
        rank that failed or gave up waiting). Raises :class:`RankDeadError` if the store is gone."""
        if self.store is None or self.world_size == 1:  # one process: the first proposal is kept here
            if self._local_decision is None:
                self._local_decision = value
            return self._local_decision
        self._status("decision")
        return self._compare_set(self._k("decision"), value)

    def post(self, name: str, value: str) -> None:
        """(one rank) Publish ``value`` under ``name`` for this operation (read with :meth:`await_value`)."""
        if self.store is None or self.world_size == 1:
            return
        self._status(name)
        self._use(name)
        self._set(self._k(name), value)

    def await_value(self, name: str, *, timeout: float, src: int = 0) -> str | None:
        """(the ranks other than ``src``) Wait up to ``timeout`` seconds for the value ``src`` posts under
        ``name`` (or for the decision, with ``name="decision"``); ``None`` at the deadline. Other ranks'
        failures are not watched (the value may come after one). Raises :class:`RankDeadError` when
        ``src``'s heartbeat stops, or (``store_lost``) when the store is gone."""
        if self.store is None or self.world_size == 1:
            return None
        self._status(name)
        self._use(name)
        key = self._k(name)

        def watch() -> bool:
            self._raise_if_heartbeat_failed()
            dead = self._dead([src])
            if dead:
                raise RankDeadError(
                    f"{self.op} of {self.target!r}: rank {src} stopped responding while rank {self.rank} waited for "
                    f"its {name!r} record (its heartbeat stopped for {knobs.dead_after():.0f}s: the process died or "
                    "is frozen)."
                )
            return False

        def stalled(elapsed: float) -> None:
            self._warn_stall(name, f"rank {src}'s {name} record", [src], elapsed, timeout)

        if not wait_until(lambda: self._check(key), timeout=timeout, watch=watch, stalled=stalled):
            return None
        return self._get(key)

    def acknowledge(self, *, timeout: float) -> list[int]:
        """(every rank, once it has read the operation's outcome) Say so on the store. Rank 0 then
        waits until every other rank has said so, or its heartbeat stopped (a dead rank is excused),
        at most ``timeout`` seconds, and returns the ranks that did neither (after a WARNING): a
        script that ends the process hosting the store right after the call strands nobody. The
        other ranks return at once; a store that is gone by then is no news to them."""
        if self.store is None or self.world_size == 1:
            return []
        self._finishing = self.rank != 0
        if self.rank != 0:
            try:
                self._set(self._k("ack", str(self.rank)), "1")
            except RankDeadError as err:
                logger.debug("shardsafe: rank %d could not acknowledge %s: %s", self.rank, self.op, err)
            return []
        self._status("ack")
        self._use("ack")
        waiting = list(range(1, self.world_size))

        def all_read() -> bool:
            nonlocal waiting
            waiting = [r for r in waiting if not self._check(self._k("ack", str(r)))]
            waiting = [r for r in waiting if r not in self._dead(waiting)]
            return not waiting

        done = wait_until(all_read, timeout=timeout)
        self._finishing = True
        if done:
            return []
        logger.warning(
            "shardsafe: %s of %s is done, but ranks %s did not confirm they read the outcome within %.0fs; "
            "returning anyway. If this process ends now and hosts the rendezvous store, those ranks may "
            "raise RankDeadError (their checkpoint is committed all the same).",
            self.op,
            self.target,
            waiting,
            timeout,
        )
        return waiting
