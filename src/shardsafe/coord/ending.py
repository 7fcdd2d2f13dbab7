"""The end of an operation on one rank: raising what an outcome says (:func:`settle`, the same on every
rank) and acknowledging that the outcome was read (:func:`acknowledge`: rank 0 returns only once every
live rank has, so a script that ends right after the call strands nobody)."""

from __future__ import annotations

import logging

from shardsafe.coord.failures import error_for
from shardsafe.coord.liveness import Watch
from shardsafe.coord.messages import Outcome, Timeout
from shardsafe.coord.session import Session
from shardsafe.deadline import DIAGNOSTIC, Deadline
from shardsafe.errors import RankDeadError, RankTimeoutError

logger = logging.getLogger(__name__)


def settle(s: Session, outcome: Outcome, own: BaseException | None) -> None:
    """(every rank) Raise what ``outcome`` says when it is a failure or a timeout (the same on every
    rank; ``own``: this rank's own error, raised as it is when the failure is its own)."""
    if outcome.failure is not None or outcome.timeout is not None:
        s.outcome_known = True
    if outcome.failure is not None:
        mine = own if own is not None else s.own_decided
        raise error_for(outcome.failure, rank=s.global_rank, op=s.op, target=s.target, own=mine)
    if outcome.timeout is not None:
        t = outcome.timeout
        lines = s.status_lines(Deadline.after(1.0, DIAGNOSTIC), [*t.missing, 0, s.rank, *t.arrived])
        raise RankTimeoutError(describe_timeout(s, t, lines), missing_ranks=t.missing)


def describe_timeout(s: Session, t: Timeout, lines: list[str]) -> str:
    """The message of a timeout outcome, as rank ``s.rank`` raises it."""
    picture = "\n".join(lines)
    phase = t.phase
    if t.by != s.rank and s.rank in t.missing:
        head = (
            f"{s.op} of {s.target!r}: rank {t.by} gave up waiting for this rank (rank {s.rank}) in phase {phase!r} "
            f"after {t.seconds:.0f}s; this rank came too late. Raise timeout= (or SHARDSAFE_TIMEOUT / "
            "SHARDSAFE_IO_TIMEOUT) if it is merely slow."
        )
    elif phase == s.first_phase and t.budget == "arrive":
        head = (
            f"{s.op} of {s.target!r}: rank {s.rank} waited {t.seconds:.0f}s for every rank to arrive, but ranks "
            f"{t.missing} never arrived. Call {s.op}() on every rank of the process group, with the same path; the "
            "library decides who reads and writes what. (If those ranks are merely slow, raise timeout= or "
            "SHARDSAFE_TIMEOUT.)"
        )
    else:
        head = (
            f"{s.op} of {s.target!r}: rank {s.rank} waited {t.seconds:.0f}s in phase {phase!r}, but ranks "
            f"{t.missing} did not get there (slow storage, or a hang or crash on those ranks). If they are merely "
            "slow, raise timeout= or SHARDSAFE_IO_TIMEOUT."
        )
    return f"{head} Where each rank was:\n{picture}"


def acknowledge(s: Session) -> list[int]:
    """(every rank, once it has read the operation's outcome) Say so. Rank 0 waits until every other
    rank has said so or is dead (its heartbeat stopped), within the call's end (at most the arrival
    budget from now), and returns the ranks that did neither (after a WARNING): a script that ends
    the process hosting the store right after the call strands nobody."""
    if s.single:
        return []
    assert s.client is not None
    client = s.client
    bound = s.clock.end.or_grace().within(s.clock.budget.arrive, "acknowledge")
    count, every = s.key("ack", "n"), s.key("ack", "all")
    s.use("ack", ("n", "all"))
    if s.rank != 0:
        try:
            if client.add(count, 1, bound, s.tally) == s.world_size - 1:
                client.set(every, "1", bound, s.tally)
        except RankDeadError as err:  # the store is gone: nobody is left to tell
            logger.debug("shardsafe: rank %d could not acknowledge %s: %s", s.rank, s.op, err)
        return []
    excused: set[int] = set()

    def excuse(ranks: list[int], _silent: float) -> None:
        for r in ranks:
            if r not in excused:
                excused.add(r)
                if client.add(count, 1, bound) == s.world_size - 1:
                    client.set(every, "1", bound)

    others = list(range(1, s.world_size))
    watch = Watch(lambda: others, excuse)
    assert s.dog is not None
    s.dog.watch(watch)
    try:
        got = client.wait_value(every, bound, tally=s.tally, wake=watch.wake)
    except RankDeadError as err:
        logger.warning(
            "shardsafe: %s of %s is done, but the store went away before every rank confirmed: %s",
            s.op,
            s.target,
            err,
        )
        return others
    finally:
        s.dog.unwatch(watch)
    if got is not None:
        return sorted(excused)
    logger.warning(
        "shardsafe: %s of %s is done, but some ranks did not confirm they read the outcome within %.0fs; "
        "returning anyway. If this process ends now and hosts the rendezvous store, those ranks may raise "
        "RankDeadError (a committed checkpoint stays committed).",
        s.op,
        s.target,
        bound.seconds,
    )
    return others
