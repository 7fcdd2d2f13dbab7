"""The keys and store requests of one round of an operation (:class:`Wire`). The engine
(:class:`~shardsafe.coord.operation.Operation`) is their one user.

Store keys of one round, under ``<operation>/<phase>/``::

    m          every rank's message, appended (one line per rank: an Envelope)
    n          how many ranks other than 0 have sent theirs (``add``)
    ready      set by the last of them, or by anyone proposing an outcome early (rank 0 waits on it)
    outcome    the outcome: the first ``compare_set`` wins, so every rank reads the same one
    decision   (a commitment only) "go", or an abort: the first ``compare_set`` wins

Requests per round: a rank other than 0 posts its message, makes one ``add`` and one blocking ``get``
of the outcome (and posts ``ready`` when it is the last); rank 0 makes one blocking ``get`` of
``ready``, one ``get`` of ``m`` and one ``compare_set`` of the outcome (a commitment: one more, of the
decision). None of this grows with the number of ranks.

Early outcomes (all ``compare_set`` on ``outcome``, then ``ready`` posted so rank 0 wakes):
- a rank that failed sends its failure as its message and proposes it as the outcome at once, so the
  others raise within a second instead of at the deadline;
- a rank that gives up at its deadline proposes a :class:`~shardsafe.coord.messages.Timeout` naming the
  ranks whose messages never came;
- the watchdog of a waiting rank proposes "rank r is dead" for a rank whose heartbeat stopped
  (:mod:`~shardsafe.coord.liveness`). A rank that was frozen and wakes up reads that outcome too.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable

from shardsafe import knobs
from shardsafe.coord.liveness import Watch
from shardsafe.coord.messages import Envelope, Outcome, Timeout
from shardsafe.coord.session import Session
from shardsafe.deadline import DIAGNOSTIC, Deadline
from shardsafe.errors import CheckpointError

logger = logging.getLogger(__name__)

GO = "go"
"""The value of a commitment's decision key that lets rank 0 act."""

ROUND_KEYS = ("m", "n", "ready", "outcome")


class Wire:
    """The keys and requests of the round ``phase`` of ``s``; see the module docstring."""

    def __init__(self, s: Session, phase: str, *, decision: bool = False) -> None:
        self.s = s
        self.phase = phase
        self.m = s.key(phase, "m")
        self.n = s.key(phase, "n")
        self.ready = s.key(phase, "ready")
        self.outcome = s.key(phase, "outcome")
        self.decision = s.key(phase, "decision")
        s.use(phase, (*ROUND_KEYS, "decision") if decision else ROUND_KEYS)

    # ------------------------------------------------------------------------------ requests

    def send(self, envelope: Envelope, deadline: Deadline) -> None:
        """(any rank) Post this rank's message; a rank other than 0 also counts itself in, and the last
        one posts ``ready``."""
        s = self.s
        client = s.client
        assert client is not None
        client.append(self.m, envelope.to_text() + "\n", deadline, s.tally)
        if s.rank != 0 and client.add(self.n, 1, deadline, s.tally) == s.world_size - 1:
            client.set(self.ready, "1", deadline, s.tally)

    def propose(self, outcome: Outcome, deadline: Deadline) -> Outcome:
        """(any rank, or a watchdog) Propose ``outcome`` unless one is settled; the settled one (which may be
        another's). Also posts ``ready``, so rank 0 stops waiting for messages."""
        s = self.s
        assert s.client is not None
        settled = s.client.compare_set(self.outcome, outcome.to_text(), deadline, s.tally)
        s.client.set(self.ready, "1", deadline, s.tally)
        return outcome if settled == outcome.to_text() else Outcome.from_text(settled)

    def decide(self, value: str, deadline: Deadline) -> str:
        """(a commitment: rank 0 with "go", any rank with an abort) Propose ``value`` as the decision
        unless one is settled; the settled one."""
        s = self.s
        assert s.client is not None
        return s.client.compare_set(self.decision, value, deadline, s.tally)

    def read_decision(self, deadline: Deadline) -> str:
        """(rank 0, woken by a decision proposed early) The settled decision."""
        s = self.s
        assert s.client is not None
        return s.client.get(self.decision, deadline, s.tally)

    def settled_early(self, deadline: Deadline) -> Outcome | None:
        """(rank 0, woken before every message came, or by a failure) The outcome proposed early, if any."""
        s = self.s
        assert s.client is not None
        if s.client.check([self.outcome], deadline, s.tally):
            return Outcome.from_text(s.client.get(self.outcome, deadline, s.tally))
        return None

    def messages(self, deadline: Deadline) -> dict[int, Envelope]:
        """(a rank that sent its own message, so the key exists) Every message sent so far, by rank (the
        first per rank)."""
        s = self.s
        assert s.client is not None
        out: dict[int, Envelope] = {}
        for line in s.client.get(self.m, deadline, s.tally).splitlines():
            if line:
                env = Envelope.from_text(line)
                out.setdefault(env.rank, env)
        return out

    def wait(
        self,
        key: str,
        deadline: Deadline,
        watch: Watch | None,
        stalled: Callable[[float], None],
        interrupt: Callable[[], None] | None = None,
    ) -> str | None:
        """(one rank) The value of ``key`` once set, or ``None`` at ``deadline``. The watchdog watches
        ``watch`` meanwhile; ``stalled(elapsed)`` runs once after ``SHARDSAFE_STALL_FRACTION`` of the
        wait's deadline (in the first round, the arrival: after ``SHARDSAFE_ARRIVAL_STALL_SECONDS`` if that
        is sooner); ``interrupt()`` runs whenever the wait wakes and may raise to end it."""
        s = self.s
        assert s.client is not None
        started = time.monotonic()
        warned = False
        after = knobs.stall_fraction() * min(deadline.seconds, 1e9)
        if not s.arrived_all:
            after = min(after, knobs.arrival_stall_seconds())

        def check() -> None:
            nonlocal warned
            if not warned and time.monotonic() - started > after:
                warned = True
                stalled(time.monotonic() - started)
            if interrupt is not None:
                interrupt()

        if watch is not None:
            assert s.dog is not None
            s.dog.watch(watch)
        try:
            return s.client.wait_value(
                key, deadline, tally=s.tally, interrupt=check, wake=watch.wake if watch is not None else None
            )
        finally:
            if watch is not None:
                assert s.dog is not None
                s.dog.unwatch(watch)

    # ------------------------------------------------------------------------------ watches

    def watch_leader(self, on_dead: Callable[[list[int], float], None] | None = None) -> Watch:
        """(a rank other than 0, waiting for the outcome) Watch rank 0, once it is inside the operation."""
        s = self.s
        return Watch(lambda: [0] if s.leader_present() else [], on_dead or self._dead_verdict)

    def watch_others(self, on_dead: Callable[[list[int], float], None] | None = None) -> Watch:
        """(rank 0, waiting for the messages of a round after the first: every rank is inside the
        operation by then) Watch every other rank."""
        others = list(range(1, self.s.world_size))
        return Watch(lambda: others, on_dead or self._dead_verdict)

    def _dead_verdict(self, ranks: list[int], silent: float) -> None:
        """(watchdog thread) Propose "rank r is dead" as this round's outcome."""
        self.propose(
            Outcome(failure=self.s.dead_failure(ranks[0], self.phase, silent)),
            Deadline.after(knobs.dead_after(), "store"),
        )

    # ------------------------------------------------------------------------------ deadlines

    def timeout(self, deadline: Deadline) -> Outcome:
        """(a rank whose deadline passed) The timeout it proposes, naming the ranks whose messages never
        came (a rank other than 0 names rank 0, whose outcome never came)."""
        s = self.s
        sent = set(self.messages(deadline.or_grace()))
        arrived = sorted(sent | ({0} if s.rank == 0 or s.leader_present() else set()))
        missing = [x for x in range(s.world_size) if x not in arrived] if s.rank == 0 else [0]
        return Outcome(timeout=Timeout(s.rank, self.phase, arrived, missing, deadline.budget, deadline.seconds))

    def stalled(self, what: str, deadline: Deadline) -> Callable[[float], None]:
        """The report a wait makes once it has waited long (see :meth:`wait`)."""

        def report(elapsed: float) -> None:
            s = self.s
            try:
                bound = Deadline.after(knobs.error_report_seconds(), DIAGNOSTIC)
                sent = set(self.messages(bound)) | {0}
                missing = [r for r in range(s.world_size) if r not in sent] if s.rank == 0 else [0]
                lines = s.status_lines(bound, [0, *missing] if s.rank == 0 else [0, s.rank])
            except CheckpointError as err:
                missing, lines = [], [f"  (the store did not answer: {err})"]
            stack = "".join(traceback.format_stack(limit=12)[:-3])
            hint = ""
            if not s.arrived_all:  # the arrival: the usual cause is a call made on some ranks only
                hint = (
                    f"\nIf ranks {missing} never call {s.op}() (a call guarded by `if rank == 0:`), the ranks that "
                    f"did raise RankTimeoutError in {deadline.remaining():.0f}s, at the arrival deadline (timeout= or "
                    f"SHARDSAFE_TIMEOUT): call {s.op}() on every rank; shardsafe decides who writes what."
                )
            logger.warning(
                "shardsafe: rank %d has waited %.1fs of %.0fs for %s (%s of %s, phase %s); not there yet: %s%s\n"
                "ranks:\n%s\nwaiting at:\n%s",
                s.rank,
                elapsed,
                deadline.seconds,
                what,
                s.op,
                s.target,
                self.phase,
                missing,
                hint,
                "\n".join(lines),
                stack,
            )

        return report
