"""An agreement (a :class:`~shardsafe.coord.rounds.Round` run on every rank): every rank sends its typed
message, rank 0 decides, every rank gets the same typed decision, or raises the same failure. The
store keys and requests are :mod:`shardsafe.coord.wire`'s.

The first round of an operation also carries each rank's :class:`~shardsafe.coord.messages.Arrival`:
ranks doing different things raise :class:`RankDesyncError`; a rank that comes after the others gave
up on that operation skips it and meets them at the next one."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

from shardsafe.coord.ending import settle
from shardsafe.coord.failures import Failure
from shardsafe.coord.messages import Arrival, Empty, Envelope, Message, Outcome
from shardsafe.coord.rounds import Round
from shardsafe.coord.session import Session
from shardsafe.coord.wire import Wire
from shardsafe.deadline import Deadline
from shardsafe.errors import CheckpointError, InternalError, RankDesyncError

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
D = TypeVar("D", bound=Message)


def agree(
    s: Session,
    rnd: Round[M, D],
    mine: M | None,
    decide: Callable[[dict[int, M]], D] | None,
    *,
    deadline: Deadline,
    failure: BaseException | None = None,
    failed_in: str | None = None,
) -> D:
    """(every rank) See :meth:`Operation.agree <shardsafe.coord.operation.Operation.agree>`."""
    own = failure
    while True:
        outcome = _one(s, rnd, mine, decide, deadline, own, failed_in or rnd.phase)
        first = not s.arrived_all
        if outcome.timeout is not None and first and s.rank not in outcome.timeout.arrived and s.rank != 0:
            logger.warning(
                "shardsafe: rank %d arrived at %s %s after ranks %s gave up waiting (they timed out); moving on to "
                "the next operation",
                s.rank,
                s.op,
                s.target,
                outcome.timeout.arrived,
            )
            s.next_sequence()
            continue
        break
    if first:
        s.arrived_all = True
        if outcome.body is not None:
            s.clean_previous()  # every rank is here: none reads the channel's earlier operations any more
    settle(s, outcome, own)
    return rnd.decision.from_json(outcome.body if outcome.body is not None else {})


def _one(
    s: Session,
    rnd: Round[M, D],
    mine: M | None,
    decide: Callable[[dict[int, M]], D] | None,
    deadline: Deadline,
    own: BaseException | None,
    failed_in: str,
) -> Outcome:
    first = not s.arrived_all
    phase = rnd.phase
    if first:
        s.first_phase = phase
    s.status(phase)
    arrival = replace(s.arrival, oldest_open=s.oldest_open()) if first else None
    failure = s.failure_of(own, failed_in) if own is not None else None
    envelope = Envelope(s.rank, None if mine is None else mine.to_json(), failure, arrival)
    if s.single:
        return _decide(s, rnd, {0: envelope}, decide, first)
    w = Wire(s, phase)
    w.send(envelope, deadline.or_grace())
    if failure is not None and not first:  # tell everyone now, not when the slowest rank gets here (in the
        return w.propose(Outcome(failure=failure), deadline.or_grace())  # first, ranks out of step come first)
    if s.rank != 0:
        raw = w.wait(w.outcome, deadline, w.watch_leader(), w.stalled("rank 0's decision", deadline))
        return Outcome.from_text(raw) if raw is not None else w.propose(w.timeout(deadline), deadline.or_grace())
    if first:
        s.announce_leader(deadline)
    watch = None if first else w.watch_others()  # in the first, a rank not there yet is not inside: the deadline's
    got = w.wait(w.ready, deadline, watch, w.stalled(f"every rank to reach {phase!r}", deadline))
    if got is None:
        return w.propose(w.timeout(deadline), deadline.or_grace())
    envelopes = w.messages(deadline.or_grace())
    if len(envelopes) < s.world_size or any(e.failure is not None for e in envelopes.values()):
        early = w.settled_early(deadline.or_grace())  # proposed early: a failure, a verdict
        if early is not None:
            return early
    return w.propose(_decide(s, rnd, envelopes, decide, first), deadline.or_grace())


def _decide(
    s: Session,
    rnd: Round[M, D],
    envelopes: dict[int, Envelope],
    decide: Callable[[dict[int, M]], D] | None,
    first: bool,
) -> Outcome:
    """(rank 0) The outcome of an agreement whose messages are all in."""
    phase = rnd.phase
    missing = [r for r in range(s.world_size) if r not in envelopes]
    if missing:
        raise InternalError(f"{s.op} of {s.target!r}: ranks {missing} counted in without a message in phase {phase!r}")
    if first:  # ranks doing different things: that, not what failed in them, is the outcome
        desync = _out_of_step(s, envelopes)
        if desync is not None:
            return Outcome(failure=Failure.of(desync, rank=0, phase=phase, decided=True))
    for r in sorted(envelopes):
        if envelopes[r].failure is not None:
            return Outcome(failure=envelopes[r].failure)
    try:
        messages = {r: rnd.message.from_json(envelopes[r].body or {}) for r in sorted(envelopes)}
        if decide is None:
            if rnd.decision is not Empty:
                raise InternalError(f"{s.op} of {s.target!r}: rank 0 has no decision to make in phase {phase!r}")
            return Outcome(body={})
        body = decide(messages)
    except CheckpointError as err:
        s.own_decided = err
        return Outcome(failure=Failure.of(err, rank=s.global_rank, phase=phase, decided=True))
    return Outcome(body=body.to_json())


def _out_of_step(s: Session, envelopes: dict[int, Envelope]) -> RankDesyncError | None:
    arrivals = {r: e.arrival for r, e in envelopes.items()}
    if any(a is None for a in arrivals.values()):
        lost = sorted(r for r, a in arrivals.items() if a is None)
        return RankDesyncError(f"{s.op} of {s.target!r}: ranks {lost} sent no arrival record: ranks are out of step")
    info: dict[int, Arrival] = {r: a for r, a in arrivals.items() if a is not None}
    fields = ("op", "target", "site") if s.match_site else ("op", "target")
    first = info[0]
    if all(all(getattr(a, f) == getattr(first, f) for f in fields) for a in info.values()):
        s.arrivals = [info[r] for r in range(s.world_size)]
        s.closed_below = min(a.oldest_open for a in s.arrivals)
        return None
    lines = "\n".join(f"  rank {r}: {a.op}({a.target!r}) called at {a.site}" for r, a in sorted(info.items()))
    return RankDesyncError(
        f"ranks are out of step: they met at the same point doing different things:\n{lines}\n"
        "Every rank must make the same shardsafe calls in the same order (same path, same call site); look for a "
        "rank-dependent branch before these lines."
    )
