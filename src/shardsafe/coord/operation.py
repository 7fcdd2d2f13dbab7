"""The protocol engine: one coordinated operation (a save, a load, a barrier, a resume) on every rank of
a group, run as a short sequence of declared rounds (:mod:`shardsafe.coord.rounds`).

Every cross-rank exchange goes through one :class:`Operation`: :meth:`~Operation.agree` (an agreement,
:mod:`~shardsafe.coord.agreement`), :meth:`~Operation.commit` (decide, act, confirm,
:mod:`~shardsafe.coord.commitment`), :meth:`~Operation.counters` (per-rank counters,
:mod:`~shardsafe.coord.counters`), then :meth:`~Operation.acknowledge`. Built from parts rather than
inherited: a :class:`~shardsafe.coord.session.Session` (who takes part, the keys, the tally), the
process's :class:`~shardsafe.coord.client.StoreClient` (the only path to the store) and
:class:`~shardsafe.coord.liveness.Watchdog`. With no process group (one process), or a group of one,
every round is decided locally and nothing touches a store."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from torch._C._distributed_c10d import Store

from shardsafe.coord import agreement, commitment, ending
from shardsafe.coord.client import client_for
from shardsafe.coord.counters import Counters
from shardsafe.coord.messages import Empty, Message
from shardsafe.coord.resolve import resolve_group
from shardsafe.coord.rounds import Commitment, Round
from shardsafe.coord.session import LAST_TALLY, Session
from shardsafe.deadline import Clock, Deadline, Deadlines
from shardsafe.errors import InvalidArgumentError

__all__ = ["LAST_TALLY", "Operation", "rendezvous"]

logger = logging.getLogger(__name__)
T = TypeVar("T")
M = TypeVar("M", bound=Message)
D = TypeVar("D", bound=Message)
C = TypeVar("C", bound=Message)


class Operation:
    """Cross-rank talk for one operation; create with :meth:`begin` on every rank of the group."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self._closed = False

    @classmethod
    def begin(
        cls,
        op: str,
        target: str,
        clock: Clock,
        *,
        channel: str = "misc",
        group: Any = None,
        store: Store | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        match_site: bool = False,
    ) -> Operation:
        """(every rank of the group) Start operation ``op`` on ``target``: no store request is waited
        for here (the first round is the rendezvous). ``channel``: operations of one channel are
        matched in order (saves and loads share ``ckpt``). The group comes from
        ``store``/``rank``/``world_size`` when given, else from ``group`` or the default process group,
        else it is one process. Whoever begins an operation must :meth:`close` it."""
        if store is None:
            store, rank, world_size, global_rank, namespace, identity = resolve_group(group)
        else:
            if rank is None or world_size is None:
                raise InvalidArgumentError("Operation.begin(store=...) also needs rank= and world_size=")
            global_rank, namespace, identity = rank, f"shardsafe/custom{world_size}", id(store)
        assert rank is not None and world_size is not None
        client = None if store is None or world_size == 1 else client_for(store, identity)
        s = Session(
            op,
            target,
            clock,
            client=client,
            rank=rank,
            world_size=world_size,
            global_rank=global_rank,
            namespace=namespace,
            identity=identity,
            match_site=match_site,
            channel=channel,
        )
        s.next_sequence()
        if s.dog is not None:
            assert s.client is not None
            s.client.acquire()
            s.dog.activate(clock.end.or_grace())
        LAST_TALLY[op] = s.tally
        return cls(s)

    # ------------------------------------------------------------------------------ who and where

    @property
    def rank(self) -> int:
        return self.session.rank

    @property
    def world_size(self) -> int:
        return self.session.world_size

    @property
    def global_rank(self) -> int:
        """This process's rank in the default process group (named in errors and fault points)."""
        return self.session.global_rank

    @property
    def single(self) -> bool:
        """One process (no store): every round is decided locally."""
        return self.session.single

    @property
    def clock(self) -> Clock:
        return self.session.clock

    @property
    def seq(self) -> int:
        return self.session.seq

    @property
    def outcome_known(self) -> bool:
        """True once this rank read an outcome that says the operation failed (it raises that)."""
        return self.session.outcome_known

    # ------------------------------------------------------------------------------ rounds

    def agree(
        self,
        rnd: Round[M, D],
        mine: M | None,
        decide: Callable[[dict[int, M]], D] | None = None,
        *,
        deadline: Deadline | None = None,
        failure: BaseException | None = None,
        failed_in: str | None = None,
    ) -> D:
        """(every rank) One agreement: send ``mine`` (or ``failure``, this rank's error, raised in phase
        ``failed_in``: then every rank raises, this one its own error); rank 0 decides with ``decide``
        (called on rank 0 only, with every rank's message; none for a round whose decision is
        :class:`~shardsafe.coord.messages.Empty`); every rank returns the same decision, or raises the
        same failure. ``deadline``: the arrival deadline for the first round of the operation, else the
        end of the call. Raises :class:`RankTimeoutError` at ``deadline``."""
        s = self.session
        if deadline is None:
            deadline = s.clock.arrive if not s.arrived_all else s.clock.end
        return agreement.agree(s, rnd, mine, decide, deadline=deadline, failure=failure, failed_in=failed_in)

    def commit(
        self,
        step: Commitment[M, C],
        mine: M | None,
        *,
        failure: BaseException | None = None,
        failed_in: str,
        decide: Callable[[dict[int, M]], T],
        act: Callable[[T], C],
        acted_failed: Callable[[BaseException], BaseException | None],
        abandon: Callable[[], None],
        probe: Callable[[str, BaseException | None], C],
        on_phase: Callable[[str], None],
    ) -> C:
        """(every rank) Decide, act, confirm (:mod:`~shardsafe.coord.commitment`, whose :class:`Step
        <shardsafe.coord.commitment.Step>` says what each callable does): returns the confirmation on
        every rank once rank 0 acted, else raises the same failure on every rank (after ``abandon``
        and the acknowledgement). The caller acknowledges after a confirmation."""
        run = commitment.Step(
            self.session,
            step,
            decide=decide,
            act=act,
            acted_failed=acted_failed,
            abandon=abandon,
            probe=probe,
            on_phase=on_phase,
            acknowledge=self.acknowledge,
        )
        confirmed: C = run.run(mine, failure, failed_in)
        return confirmed

    def counters(self, name: str) -> Counters | None:
        """(every rank) The per-rank counters ``name`` of this operation; ``None`` alone (no peers)."""
        return None if self.session.single else Counters(self.session, name)

    # ------------------------------------------------------------------------------ the end

    def acknowledge(self) -> list[int]:
        """(every rank, once it has read the operation's outcome) See
        :func:`~shardsafe.coord.ending.acknowledge`; rank 0 returns the ranks that did not."""
        return ending.acknowledge(self.session)

    def conclude(self, body: Callable[[], T]) -> T:
        """(every rank) Run ``body`` (the operation's rounds and work), acknowledge the outcome it read
        (also when it raised, once an outcome was read: every rank got the same one, and rank 0 may be
        waiting for the acknowledgements) and :meth:`close`. Returns what ``body`` returns."""
        try:
            try:
                result = body()
            except BaseException:
                if self.outcome_known:
                    self.acknowledge()
                raise
            self.acknowledge()
            return result
        finally:
            self.close()

    def close(self) -> None:
        """(every rank that began the operation, once) Stop ticking for it; the last operation of the
        process to close stops the watchdog's thread and the store client's lanes, once its posted
        requests are done (nothing of it runs after the call returns). Idempotent."""
        if self._closed:
            return
        self._closed = True
        s = self.session
        s.finished()
        if s.dog is not None:
            assert s.client is not None
            try:
                s.dog.deactivate()
            finally:
                s.client.release()


ARRIVE = Round("arrive", Empty, Empty)
"""The round of an operation that is only its rendezvous."""


def rendezvous(op: str, target: str, budget: Deadlines, *, match_site: bool = False, group: Any = None) -> None:
    """(every rank) An operation that is only its first round: every rank reaches this point (within the
    arrival budget) doing the same thing (``op``, ``target``, and with ``match_site`` the same call site),
    else every rank raises (:class:`RankTimeoutError`, :class:`RankDesyncError`)."""
    meeting = Operation.begin(op, target, budget.start(), group=group, match_site=match_site)
    try:
        meeting.agree(ARRIVE, Empty())
    finally:
        meeting.close()
