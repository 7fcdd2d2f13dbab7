"""DEBUG lines for the phases of one save or load: each time an operation enters a phase, one line
names the operation, the path, the rank, the phase it leaves with the seconds spent there, and the
seconds since the operation began. Turn them on with
``logging.getLogger("shardsafe").setLevel(logging.DEBUG)``."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)


class PhaseLog:
    """The phase clock of one operation on one rank (any rank; no waiting)."""

    def __init__(self, op: str, path: str, first: str) -> None:
        self.op = op
        self.path = path
        self.phase = first
        self.started = self.entered = time.monotonic()
        self.rank: int | None = None

    def enter(self, phase: str, rank: int | None = None) -> str:
        """Leave the current phase for ``phase`` (logged at DEBUG with the timings); returns ``phase``."""
        if rank is not None:
            self.rank = rank
        now = time.monotonic()
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "shardsafe: %s %s rank %s: %s took %.3fs, entering %s at %.3fs",
                self.op,
                self.path,
                "-" if self.rank is None else self.rank,
                self.phase,
                now - self.entered,
                phase,
                now - self.started,
            )
        self.phase, self.entered = phase, now
        return phase
