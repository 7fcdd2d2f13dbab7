"""When to save: the same answer on every rank for every step.

Three triggers, checked in this order (each rank evaluates them identically, so all ranks take the
same branch and make the same store calls):

1. preemption: a step at or after the stop step agreed through :class:`StopAgreement`;
2. ``step % every_n_steps == 0``: pure arithmetic, no talk needed;
3. ``every_seconds``: only rank 0's clock counts; it decides and the others read its decision from
   the store (:class:`~shardsafe.coord.steps.StepBroadcast`, a few store calls per step where
   this is reached).

A step already saved by this manager (or resumed from) is never scheduled again, and asking twice for
the same step gives the cached answer without talking to the store again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from shardsafe.coord.rounds import Broadcast
from shardsafe.coord.steps import StepBroadcast, StopAgreement
from shardsafe.manager.config import ManagerConfig
from shardsafe.manager.preemption import SignalFlag

logger = logging.getLogger(__name__)

PREEMPTION = "preemption"
INTERVAL = "every_n_steps"
TIME = "every_seconds"

TICK = Broadcast(
    TIME,
    what="CheckpointManager.should_save",
    hint="Every rank must call should_save / maybe_save with the same steps in the same order; if rank 0 is "
    "merely slow, raise timeout=.",
)
"""Rank 0's clock decides ``every_seconds`` for every rank: the one round of the schedule."""


class Schedule:
    """(every rank) The save decisions of one manager."""

    def __init__(
        self,
        config: ManagerConfig,
        *,
        rank: int,
        flag: SignalFlag,
        stop: StopAgreement,
        tick: StepBroadcast,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.rank = rank
        self.flag = flag
        self.stop = stop
        self.tick = tick
        self.clock = clock
        self.last_saved_step: int | None = None
        self.stopped = False
        """True once the preemption checkpoint is committed."""
        self._last_save_time = clock()
        self._proposed = False
        self._cached: tuple[int, str | None] | None = None

    def reason(self, step: int) -> str | None:
        """(every rank, same steps in the same order) Why ``step`` should be saved, or ``None``.
        Non-zero ranks may wait for rank 0's decision (time-based saving only; bounded by the
        deadline of ``tick``)."""
        if self._cached is not None and self._cached[0] == step:
            return self._cached[1]
        why = self._decide(step)
        self._cached = (step, why)
        return why

    def _decide(self, step: int) -> str | None:
        if self.flag.received is not None and not self._proposed:
            self._proposed = True
            agreed = self.stop.propose(step + 1)
            logger.warning(
                "shardsafe: rank %d received %s at step %d; every rank saves at step %d, then should_stop() turns True",
                self.rank,
                self.flag.received.name,
                step,
                agreed,
            )
        stop_at = None if self.stopped else self.stop.agreed()
        if stop_at is not None and step >= stop_at:
            return PREEMPTION
        if step == self.last_saved_step:
            return None
        n = self.config.every_n_steps
        if n is not None and step % n == 0:
            return INTERVAL
        if self.config.every_seconds is not None and self._time_agreed(step):
            return TIME
        return None

    def _time_agreed(self, step: int) -> bool:
        """(every rank) Rank 0 compares its clock with ``every_seconds`` and tells the others."""
        mine = None
        if self.rank == 0:
            assert self.config.every_seconds is not None
            mine = "1" if self.clock() - self._last_save_time >= self.config.every_seconds else "0"
        return self.tick.share(step, mine) == "1"

    @property
    def stop_step(self) -> int | None:
        """The agreed preemption step, if any rank asked to stop (no store call once known)."""
        return self.stop.agreed()

    def started(self) -> None:
        """A save starts now: the time interval counts from here."""
        self._last_save_time = self.clock()

    def pending_reason(self, step: int) -> str | None:
        """The answer :meth:`reason` gave for ``step`` if it was the last step asked about (no store
        call): how a save of ``step`` was triggered."""
        return self._cached[1] if self._cached is not None and self._cached[0] == step else None

    def saved(self, step: int) -> None:
        """(every rank) The save of ``step`` is done (committed, or handed to the background when
        async). A preemption save ends the run: :attr:`stopped` turns True."""
        if self.pending_reason(step) == PREEMPTION:
            self.stopped = True
        self.last_saved_step = step
        self._cached = (step, None)
