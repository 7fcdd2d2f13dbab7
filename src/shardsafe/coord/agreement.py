"""The one agreement primitive: every rank sends a typed message, rank 0 decides, every rank gets the
same typed outcome (or raises the same failure).

Store keys of one agreement (a :class:`Round`), under ``<operation>/<phase>/``::

    m          every rank's message, appended (one line per rank: an Envelope)
    n          how many ranks other than 0 have sent theirs (``add``)
    ready      set by the last of them, or by anyone proposing an outcome early (rank 0 waits on it)
    outcome    the outcome: the first ``compare_set`` wins, so every rank reads the same one

Requests per agreement: a rank other than 0 posts its message, makes one ``add`` and one blocking
``get`` of the outcome (and posts ``ready`` when it is the last); rank 0 makes one blocking ``get`` of
``ready``, one ``get`` of ``m`` and one ``compare_set`` of the outcome. None of this grows with the
number of ranks.

Early outcomes (all ``compare_set`` on ``outcome``, then ``ready`` posted so rank 0 wakes):
- a rank that failed sends its failure as its message and proposes it as the outcome at once, so the
  others raise within a second instead of at the deadline;
- a rank that gives up at its deadline proposes a :class:`~shardsafe.coord.messages.Timeout` naming the
  ranks whose messages never came;
- the watchdog of a waiting rank proposes "rank r is dead" for a rank whose heartbeat stopped
  (:mod:`~shardsafe.coord.liveness`). A rank that was frozen and wakes up reads that outcome too.
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from shardsafe import knobs
from shardsafe.coord.failures import Failure
from shardsafe.coord.liveness import Watch
from shardsafe.coord.messages import Arrival, Body, Envelope, Outcome, Timeout
from shardsafe.deadline import Deadline
from shardsafe.errors import CheckpointError, InternalError, RankDesyncError

if TYPE_CHECKING:
    from shardsafe.coord.operation import Operation

logger = logging.getLogger(__name__)

Decide = Callable[[dict[int, Envelope]], Body | None]
"""(rank 0) Every rank's envelope (none holds a failure) -> the outcome's body; raising a
:class:`CheckpointError` makes that error the outcome for everyone (a decided failure)."""


class Round:
    """The keys and requests of one agreement of ``op``; see the module docstring."""

    def __init__(self, op: Operation, phase: str) -> None:
        self.op = op
        self.phase = phase
        self.m = op.key(phase, "m")
        self.n = op.key(phase, "n")
        self.ready = op.key(phase, "ready")
        self.outcome = op.key(phase, "outcome")
        op.used.add(phase)

    # ------------------------------------------------------------------------------ requests

    def send(self, envelope: Envelope, deadline: Deadline) -> None:
        """(any rank) Post this rank's message; a rank other than 0 also counts itself in, and the last
        one posts ``ready``."""
        op = self.op
        client = op.client
        assert client is not None
        client.append(self.m, envelope.to_text() + "\n", deadline, op.tally)
        if op.rank != 0 and client.add(self.n, 1, deadline, op.tally) == op.world_size - 1:
            client.set(self.ready, "1", deadline, op.tally)

    def propose(self, outcome: Outcome, deadline: Deadline) -> Outcome:
        """(any rank, or a watchdog) Propose ``outcome`` unless one is settled; the settled one (which may be
        another's). Also posts ``ready``, so rank 0 stops waiting for messages."""
        op = self.op
        assert op.client is not None
        settled = op.client.compare_set(self.outcome, outcome.to_text(), deadline, op.tally)
        op.client.set(self.ready, "1", deadline, op.tally)
        return outcome if settled == outcome.to_text() else Outcome.from_text(settled)

    def messages(self, deadline: Deadline) -> dict[int, Envelope]:
        """(a rank that sent its own message, so the key exists) Every message sent so far, by rank (the
        first per rank)."""
        op = self.op
        assert op.client is not None
        out: dict[int, Envelope] = {}
        for line in op.client.get(self.m, deadline, op.tally).splitlines():
            if line:
                env = Envelope.from_text(line)
                out.setdefault(env.rank, env)
        return out

    def wait(self, key: str, deadline: Deadline, watch: Watch | None, stalled: Callable[[float], None]) -> str | None:
        """(one rank) The value of ``key`` once set, or ``None`` at ``deadline``. The watchdog watches
        ``watch`` meanwhile; ``stalled(elapsed)`` runs once after ``SHARDSAFE_STALL_FRACTION`` of the
        wait's deadline (in the first agreement, the arrival: after ``SHARDSAFE_ARRIVAL_STALL_SECONDS``
        if that is sooner)."""
        op = self.op
        assert op.client is not None and op.dog is not None
        started = time.monotonic()
        warned = False
        after = knobs.stall_fraction() * min(deadline.seconds, 1e9)
        if not op.arrived_all:
            after = min(after, knobs.arrival_stall_seconds())

        def interrupt() -> None:
            nonlocal warned
            if not warned and time.monotonic() - started > after:
                warned = True
                stalled(time.monotonic() - started)

        if watch is not None:
            op.dog.watch(watch)
        try:
            return op.client.wait_value(
                key, deadline, tally=op.tally, interrupt=interrupt, wake=watch.wake if watch is not None else None
            )
        finally:
            if watch is not None:
                op.dog.unwatch(watch)

    # ------------------------------------------------------------------------------ watches

    def watch_leader(self, on_dead: Callable[[list[int], float], None] | None = None) -> Watch:
        """(a rank other than 0, waiting for the outcome) Watch rank 0, once it is inside the operation."""
        op = self.op
        return Watch(lambda: [0] if op.leader_present() else [], on_dead or self._dead_verdict)

    def watch_others(self, on_dead: Callable[[list[int], float], None] | None = None) -> Watch:
        """(rank 0, waiting for the messages of an agreement after the first: every rank is inside the
        operation by then) Watch every other rank."""
        others = list(range(1, self.op.world_size))
        return Watch(lambda: others, on_dead or self._dead_verdict)

    def _dead_verdict(self, ranks: list[int], silent: float) -> None:
        """(watchdog thread) Propose "rank r is dead" as this agreement's outcome."""
        self.propose(
            Outcome(failure=self.op.dead_failure(ranks[0], self.phase, silent)),
            Deadline.after(knobs.dead_after(), "store"),
        )

    # ------------------------------------------------------------------------------ stalls

    def stalled(self, what: str, deadline: Deadline) -> Callable[[float], None]:
        def report(elapsed: float) -> None:
            op = self.op
            try:
                bound = Deadline.after(knobs.error_report_seconds(), "report")
                sent = set(self.messages(bound)) | {0}
                missing = [r for r in range(op.world_size) if r not in sent] if op.rank == 0 else [0]
                lines = op.status_lines(bound)
            except CheckpointError as err:
                missing, lines = [], [f"  (the store did not answer: {err})"]
            stack = "".join(traceback.format_stack(limit=12)[:-3])
            hint = ""
            if not op.arrived_all:  # the arrival: the usual cause is a call made on some ranks only
                hint = (
                    f"\nIf ranks {missing} never call {op.op}() (a call guarded by `if rank == 0:`), the ranks that "
                    f"did raise RankTimeoutError in {deadline.remaining():.0f}s, at the arrival deadline (timeout= or "
                    f"SHARDSAFE_TIMEOUT): call {op.op}() on every rank; shardsafe decides who writes what."
                )
            logger.warning(
                "shardsafe: rank %d has waited %.1fs of %.0fs for %s (%s of %s, phase %s); not there yet: %s%s\n"
                "ranks:\n%s\nwaiting at:\n%s",
                op.rank,
                elapsed,
                deadline.seconds,
                what,
                op.op,
                op.target,
                self.phase,
                missing,
                hint,
                "\n".join(lines),
                stack,
            )

        return report


def agree(
    op: Operation,
    phase: str,
    mine: Body | None,
    decide: Decide | None,
    *,
    deadline: Deadline,
    failure: BaseException | None = None,
    failed_in: str | None = None,
) -> dict[str, Any]:
    """(every rank of ``op``) One agreement: send ``mine`` (or ``failure``, this rank's error, raised in
    phase ``failed_in``: then every rank raises, this one its own error); rank 0 decides with ``decide``
    once every message is in; every rank returns the same body, or raises the same failure. The first agreement of an
    operation also carries each rank's :class:`Arrival` (ranks doing different things raise
    :class:`RankDesyncError`); a rank that comes after the others gave up on that operation skips it
    and meets them at the next one. Raises :class:`RankTimeoutError` at ``deadline``."""
    own = failure
    while True:
        outcome = _one(op, phase, mine, decide, deadline, own, failed_in or phase)
        first = not op.arrived_all
        if outcome.timeout is not None and first and op.rank not in outcome.timeout.arrived and op.rank != 0:
            logger.warning(
                "shardsafe: rank %d arrived at %s %s after ranks %s gave up waiting (they timed out); moving on to "
                "the next operation",
                op.rank,
                op.op,
                op.target,
                outcome.timeout.arrived,
            )
            op.next_sequence()
            continue
        break
    if first:
        op.arrived_all = True
        if outcome.body is not None:
            op.clean_previous()  # every rank is here: none reads the channel's earlier operations any more
    return op.settle(outcome, own)


def _one(
    op: Operation,
    phase: str,
    mine: Body | None,
    decide: Decide | None,
    deadline: Deadline,
    own: BaseException | None,
    failed_in: str,
) -> Outcome:
    first = not op.arrived_all
    if first:
        op.first_phase = phase
    op.status(phase)
    arrival = op.arrival if first else None
    failure = op.failure_of(own, failed_in) if own is not None else None
    envelope = Envelope(op.rank, None if mine is None else mine.to_json(), failure, arrival)
    if op.single:
        return _decide(op, phase, {0: envelope}, decide, first)
    r = Round(op, phase)
    r.send(envelope, deadline.or_grace())
    if failure is not None and not first:  # tell everyone now, not when the slowest rank gets here (in the
        return r.propose(Outcome(failure=failure), deadline.or_grace())  # first, ranks out of step come first)
    if op.rank != 0:
        raw = r.wait(r.outcome, deadline, r.watch_leader(), r.stalled("rank 0's decision", deadline))
        return Outcome.from_text(raw) if raw is not None else _give_up(r, deadline)
    if first:
        op.announce_leader(deadline)
    watch = None if first else r.watch_others()  # in the first, a rank not there yet is not inside: the deadline's
    got = r.wait(r.ready, deadline, watch, r.stalled(f"every rank to reach {phase!r}", deadline))
    if got is None:
        return _give_up(r, deadline)
    envelopes = r.messages(deadline.or_grace())
    if len(envelopes) < op.world_size or any(e.failure is not None for e in envelopes.values()):
        assert op.client is not None
        if op.client.check([r.outcome], deadline.or_grace(), op.tally):  # proposed early: a failure, a verdict
            return Outcome.from_text(op.client.get(r.outcome, deadline.or_grace(), op.tally))
    return r.propose(_decide(op, phase, envelopes, decide, first), deadline.or_grace())


def _decide(op: Operation, phase: str, envelopes: dict[int, Envelope], decide: Decide | None, first: bool) -> Outcome:
    """(rank 0) The outcome of an agreement whose messages are all in."""
    missing = [r for r in range(op.world_size) if r not in envelopes]
    if missing:
        raise InternalError(
            f"{op.op} of {op.target!r}: ranks {missing} counted in without a message in phase {phase!r}"
        )
    if first:  # ranks doing different things: that, not what failed in them, is the outcome
        desync = _out_of_step(op, envelopes)
        if desync is not None:
            return Outcome(failure=Failure.of(desync, rank=0, phase=phase, decided=True))
    for r in sorted(envelopes):
        if envelopes[r].failure is not None:
            return Outcome(failure=envelopes[r].failure)
    if decide is None:
        return Outcome(body={})
    try:
        body = decide(envelopes)
    except CheckpointError as err:
        op.own_decided = err
        return Outcome(failure=Failure.of(err, rank=op.global_rank, phase=phase, decided=True))
    return Outcome(body=None if body is None else body.to_json())


def _out_of_step(op: Operation, envelopes: dict[int, Envelope]) -> RankDesyncError | None:
    arrivals = {r: e.arrival for r, e in envelopes.items()}
    if any(a is None for a in arrivals.values()):
        lost = sorted(r for r, a in arrivals.items() if a is None)
        return RankDesyncError(f"{op.op} of {op.target!r}: ranks {lost} sent no arrival record: ranks are out of step")
    info: dict[int, Arrival] = {r: a for r, a in arrivals.items() if a is not None}
    fields = ("op", "target", "site") if op.match_site else ("op", "target")
    first = info[0]
    if all(all(getattr(a, f) == getattr(first, f) for f in fields) for a in info.values()):
        op.arrivals = [info[r] for r in range(op.world_size)]
        return None
    lines = "\n".join(f"  rank {r}: {a.op}({a.target!r}) called at {a.site}" for r, a in sorted(info.items()))
    return RankDesyncError(
        f"ranks are out of step: they met at the same point doing different things:\n{lines}\n"
        "Every rank must make the same shardsafe calls in the same order (same path, same call site); look for a "
        "rank-dependent branch before these lines."
    )


def _give_up(r: Round, deadline: Deadline) -> Outcome:
    """(a rank whose deadline passed) Propose a timeout naming the ranks whose messages never came."""
    op = r.op
    bound = deadline.or_grace()
    sent = set(r.messages(bound))
    arrived = sorted(sent | ({0} if op.rank == 0 or op.leader_present() else set()))
    missing = [x for x in range(op.world_size) if x not in arrived] if op.rank == 0 else [0]
    if op.rank != 0 and 0 in arrived:
        missing = [0]
    timeout = Timeout(op.rank, r.phase, arrived, missing, deadline.budget, deadline.seconds)
    return r.propose(Outcome(timeout=timeout), bound)


def describe_timeout(op: Operation, t: Timeout, lines: list[str]) -> str:
    """The message of a timeout outcome, as rank ``op.rank`` raises it."""
    picture = "\n".join(lines)
    phase = t.phase
    if t.by != op.rank and op.rank in t.missing:
        head = (
            f"{op.op} of {op.target!r}: rank {t.by} gave up waiting for this rank (rank {op.rank}) in phase {phase!r} "
            f"after {t.seconds:.0f}s; this rank came too late. Raise timeout= (or SHARDSAFE_TIMEOUT / "
            "SHARDSAFE_IO_TIMEOUT) if it is merely slow."
        )
    elif phase == op.first_phase and t.budget == "arrive":
        head = (
            f"{op.op} of {op.target!r}: rank {op.rank} waited {t.seconds:.0f}s for every rank to arrive, but ranks "
            f"{t.missing} never arrived. Call {op.op}() on every rank of the process group, with the same path; the "
            "library decides who reads and writes what. (If those ranks are merely slow, raise timeout= or "
            "SHARDSAFE_TIMEOUT.)"
        )
    else:
        head = (
            f"{op.op} of {op.target!r}: rank {op.rank} waited {t.seconds:.0f}s in phase {phase!r}, but ranks "
            f"{t.missing} did not get there (slow storage, or a hang or crash on those ranks). If they are merely "
            "slow, raise timeout= or SHARDSAFE_IO_TIMEOUT."
        )
    return f"{head} Where each rank was:\n{picture}"


def status_record(op: Operation, phase: str) -> str:
    return json.dumps({"op": op.op, "target": op.target, "seq": op.seq, "phase": phase, "since": time.time()})
