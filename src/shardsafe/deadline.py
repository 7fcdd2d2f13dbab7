"""Time budgets and deadlines: how long a call may take, as one object that reaches every blocking step.

A call's ``timeout=`` (or ``SHARDSAFE_TIMEOUT`` / ``SHARDSAFE_IO_TIMEOUT``) is a :class:`Deadlines`
budget in seconds. When the call starts, :meth:`Deadlines.start` turns it into a :class:`Clock` of
absolute deadlines: ``arrive`` (every rank must have reached the call by then: it catches the
``if rank == 0:`` guard) and ``end`` (the call returns or raises on every rank by then). Every store
request, file and network I/O, reader and upload pool of the call is bounded by one of them
(:class:`Deadline`); nothing computes its own bound from a knob or a formula.

The bottom layers: imports :mod:`shardsafe.errors` and :mod:`shardsafe.knobs` only."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from shardsafe import knobs
from shardsafe.errors import InvalidArgumentError

DIAGNOSTIC = "diagnostic"
"""The budget of a report's own store requests (a stall or timeout report): a request of it that goes
unanswered is a line of the report, never a verdict on the store, and it gets no grace (unlike ``"report"``,
a failing operation's grace, after which the store is taken as lost)."""

LONGEST = 1e9
"""Seconds that stand for "no deadline" where a wait needs a number (about 32 years)."""


@dataclass(frozen=True)
class Deadline:
    """An absolute deadline (``time.monotonic()`` seconds) and the budget it comes from, for messages."""

    at: float
    budget: str
    """Which budget this is: ``"arrive"``, ``"end"``, or a named step (``"report"``)."""
    seconds: float
    """The length the budget was given, in seconds (named in timeout messages)."""

    @staticmethod
    def after(seconds: float, budget: str) -> Deadline:
        """A deadline ``seconds`` from now (``inf``: none)."""
        return Deadline(time.monotonic() + seconds, budget, seconds)

    def remaining(self) -> float:
        """Seconds left, never negative; at most :data:`LONGEST` (no deadline: ``timeout=inf``), so it
        can be handed to any wait."""
        return min(LONGEST, max(0.0, self.at - time.monotonic()))

    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def within(self, seconds: float, budget: str | None = None) -> Deadline:
        """The sooner of this deadline and ``seconds`` from now (named ``budget`` when that is the
        sooner one)."""
        other = time.monotonic() + seconds
        if other < self.at:
            return Deadline(other, budget or self.budget, seconds)
        return self

    def or_grace(self) -> Deadline:
        """This deadline, or, when it has passed, ``SHARDSAFE_ERROR_REPORT_SECONDS`` from now: the time a
        rank that is failing (or gave up at the deadline) may still spend telling the others. A
        :data:`DIAGNOSTIC` deadline gets no grace (a report that ran out of time is only shorter)."""
        if self.expired() and self.budget != DIAGNOSTIC:
            return Deadline.after(knobs.error_report_seconds(), "report")
        return self


NEVER = Deadline(math.inf, "none", math.inf)
"""No deadline (one process, no I/O to bound)."""


@dataclass(frozen=True)
class Clock:
    """One call's absolute deadlines, taken when the call starts (:meth:`Deadlines.start`)."""

    arrive: Deadline
    """Every rank has reached the call by then (rendezvous)."""
    work: Deadline
    """This rank's own writes, reads and fsyncs are done by then: a tenth of the whole before ``end``, so
    that a rank whose disk hangs tells the others why before they give up waiting for it."""
    end: Deadline
    """The call has returned or raised on every rank by then (writes, reads, commit included)."""
    budget: Deadlines


@dataclass(frozen=True, kw_only=True)
class Deadlines:
    """A call's time budget in seconds: the ``timeout=`` of every save, load and barrier."""

    arrive: float
    """Seconds for every rank to reach the call (catches the ``if rank == 0:`` guard)."""
    io: float
    """Seconds for the whole call, data and commit included (at least ``arrive``)."""

    def __post_init__(self) -> None:
        for name in ("arrive", "io"):
            value = getattr(self, name)
            if not value > 0 or value != value:
                raise InvalidArgumentError(f"Deadlines.{name}={value!r} must be a positive number of seconds")

    @staticmethod
    def resolve(timeout: float | Deadlines | None) -> Deadlines:
        """``timeout=`` argument, else ``SHARDSAFE_TIMEOUT`` / ``SHARDSAFE_IO_TIMEOUT``, else defaults."""
        if isinstance(timeout, Deadlines):
            return timeout
        if timeout is None:
            return Deadlines(arrive=knobs.arrive_timeout(), io=knobs.io_timeout())
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise InvalidArgumentError(f"timeout={timeout!r} must be a positive number of seconds, or None")
        return Deadlines(arrive=float(timeout), io=float(timeout))

    def start(self) -> Clock:
        """The absolute deadlines of a call starting now: arrival within ``arrive`` seconds, the end
        within ``max(arrive, io)`` (this rank's own I/O within nine tenths of that)."""
        now = time.monotonic()
        whole = max(self.arrive, self.io)
        return Clock(
            Deadline(now + self.arrive, "arrive", self.arrive),
            Deadline(now + 0.9 * whole, "end", whole),
            Deadline(now + whole, "end", whole),
            self,
        )
