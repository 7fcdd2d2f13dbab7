"""One coordinated operation (a save, a load, a barrier, a resume) on every rank of a group.

Built from parts rather than inherited: a :class:`~shardsafe.coord.client.StoreClient` (the only path
to the store), the process's :class:`~shardsafe.coord.liveness.Watchdog`, and agreements
(:mod:`~shardsafe.coord.agreement`). With no process group (one process), or a group of one, every
agreement is decided locally and nothing touches a store.

Operations are matched across ranks by a per-process sequence number per channel: ``ckpt`` for saves
and loads, ``misc`` for everything else. Within a channel a process runs one operation at a time (a
save or load first waits for the save in flight), so once every rank has arrived at an operation, the
keys of the ones before it are no longer read by anyone: rank 0 deletes them then (posted deletes,
not waited for), and a long run leaves nothing behind.

Store layout under ``shardsafe/<group>/``::

    <channel>/<seq>/<phase>/{m,n,ready,outcome}   one agreement (see agreement.py)
    <channel>/<seq>/present                       rank 0 is inside the operation (its watchers start then)
    <channel>/<seq>/decision                      a save's commit or abort: the first compare_set wins
    <channel>/<seq>/ack/{n,all}                   acknowledgements: rank 0 returns after every live rank's
    <channel>/<seq>/progress/r/<rank>             progress counts (progress/keys.py)
    alive/<rank>                                  the rank's heartbeat counter (liveness.py)
    status/<rank>                                 where the rank is now (stall and timeout reports)
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from torch._C._distributed_c10d import Store

from shardsafe import knobs
from shardsafe.coord.agreement import Decide, Round, agree, describe_timeout, status_record
from shardsafe.coord.client import StoreClient, Tally, client_for
from shardsafe.coord.failures import Failure, error_for
from shardsafe.coord.liveness import Watch, Watchdog, watchdog_for
from shardsafe.coord.messages import Arrival, Body, Outcome
from shardsafe.coord.resolve import call_site, channel_of, resolve_group
from shardsafe.deadline import Clock, Deadline, Deadlines
from shardsafe.errors import CheckpointError, InvalidArgumentError, RankDeadError, RankTimeoutError

logger = logging.getLogger(__name__)
T = TypeVar("T")

_seq_lock = threading.Lock()
_seq: dict[tuple[int, str], int] = {}
_used: dict[tuple[int, str, int], set[str]] = {}  # (identity, prefix, seq) -> phases rank 0 used there
LAST_TALLY: dict[str, Tally] = {}
"""The request tally of the last operation of each kind in this process (``"save"``, ``"load"``...);
read by the round-trip test and the protocol-cost bench."""


class Operation:
    """Cross-rank talk for one operation; create with :meth:`begin` on every rank of the group."""

    def __init__(
        self,
        op: str,
        target: str,
        clock: Clock,
        *,
        client: StoreClient | None,
        rank: int,
        world_size: int,
        global_rank: int,
        namespace: str,
        identity: int,
        match_site: bool,
    ) -> None:
        self.op = op
        self.target = target
        self.clock = clock
        self.client = client
        self.rank = rank
        self.world_size = world_size
        self.global_rank = global_rank
        self.namespace = namespace
        self.prefix = f"{namespace}/{channel_of(op)}"
        self.identity = identity
        self.match_site = match_site
        self.single = client is None or world_size == 1
        self.dog: Watchdog | None = None if self.single else watchdog_for(client, namespace, rank)  # type: ignore[arg-type]
        self.tally = Tally()
        self.seq = 0
        self.used: set[str] = set()
        self.arrived_all = False
        self.first_phase = ""
        self.arrival = Arrival(op, target, call_site(), socket.gethostname(), os.getpid())
        self.arrivals: list[Arrival] = [self.arrival]
        self.own_decided: CheckpointError | None = None
        self.outcome_known = False
        """True once this rank read an outcome that says the operation failed (it raises that)."""
        self._present = False
        self._closed = False

    @classmethod
    def begin(
        cls,
        op: str,
        target: str,
        clock: Clock,
        *,
        group: Any = None,
        store: Store | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        match_site: bool = False,
    ) -> Operation:
        """(every rank of the group) Start operation ``op`` on ``target``: no store request is waited
        for here (the first :meth:`agree` is the rendezvous). The group comes from
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
        self = cls(
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
        )
        self.next_sequence()
        if self.dog is not None:
            assert client is not None
            client.acquire()
            self.dog.activate(clock.end.or_grace())
        LAST_TALLY[op] = self.tally
        return self

    def next_sequence(self) -> None:
        """Take this channel's next sequence number (also to skip an operation the others abandoned)."""
        key = (self.identity, self.prefix)
        with _seq_lock:
            self.seq = _seq.get(key, 0) + 1
            _seq[key] = self.seq
        self.used = set()
        if self.rank == 0:
            _used[(self.identity, self.prefix, self.seq)] = self.used
        self._present = False

    def key(self, *parts: str) -> str:
        return "/".join((self.prefix, str(self.seq), *parts))

    # ------------------------------------------------------------------------------ agreements

    def agree(
        self,
        phase: str,
        mine: Body | None,
        decide: Decide | None = None,
        *,
        deadline: Deadline | None = None,
        failure: BaseException | None = None,
        failed_in: str | None = None,
    ) -> dict[str, Any]:
        """(every rank) One agreement (:func:`~shardsafe.coord.agreement.agree`); ``deadline``: the
        arrival deadline for the first agreement of the operation, else the end of the call."""
        if deadline is None:
            deadline = self.clock.arrive if not self.arrived_all else self.clock.end
        return agree(self, phase, mine, decide, deadline=deadline, failure=failure, failed_in=failed_in)

    def round(self, phase: str) -> Round:
        return Round(self, phase)

    def settle(self, outcome: Outcome, own: BaseException | None) -> dict[str, Any]:
        """(every rank) The body of ``outcome``, or raise what it says (the same on every rank)."""
        if outcome.failure is not None or outcome.timeout is not None:
            self.outcome_known = True
        if outcome.failure is not None:
            mine = own if own is not None else self.own_decided
            raise error_for(outcome.failure, rank=self.global_rank, op=self.op, target=self.target, own=mine)
        if outcome.timeout is not None:
            t = outcome.timeout
            lines = self.status_lines(Deadline.after(1.0, "report"))
            missing = t.missing
            raise RankTimeoutError(describe_timeout(self, t, lines), missing_ranks=missing)
        return outcome.body if outcome.body is not None else {}

    def failure_of(self, err: BaseException, phase: str, *, decided: bool = False) -> Failure:
        return Failure.of(err, rank=self.global_rank, phase=phase, decided=decided)

    def dead_failure(self, rank: int, phase: str, silent: float) -> Failure:
        """The outcome that says rank ``rank`` stopped responding (decided: every rank raises it)."""
        message = (
            f"{self.op} of {self.target!r}: rank {rank} joined but stopped responding {silent:.0f}s ago in phase "
            f"{phase!r} (its heartbeat stopped: the process died or is frozen). Nothing was committed; restart the "
            "job, it resumes from the last committed checkpoint."
        )
        return Failure(rank, phase, "RankDeadError", message, decided=True)

    # ------------------------------------------------------------------------------ presence

    def announce_leader(self, deadline: Deadline) -> None:
        """(rank 0, its first agreement) Say that rank 0 is inside the operation (its watchers start then)."""
        assert self.client is not None
        self.client.set(self.key("present"), "1", deadline.or_grace(), self.tally)

    def leader_present(self) -> bool:
        """(a watchdog, a rank giving up) Whether rank 0 is inside this operation."""
        if self._present or self.single:
            return True
        if self.arrived_all:
            self._present = True
            return True
        assert self.client is not None
        self._present = self.client.check([self.key("present")], Deadline.after(knobs.dead_after(), "store"))
        return self._present

    # ------------------------------------------------------------------------------ status

    def status(self, phase: str) -> None:
        """(every rank) Post where this rank is (read only by stall and timeout reports)."""
        if self.single:
            return
        assert self.client is not None
        self.client.set(
            f"{self.namespace}/status/{self.rank}", status_record(self, phase), self.clock.end.or_grace(), self.tally
        )

    def status_lines(self, deadline: Deadline) -> list[str]:
        """One line per rank: where it was last (error path: one request per rank at most)."""
        if self.single or self.client is None:
            return [f"  rank 0: {self.op}({self.target!r})"]
        lines = []
        now = time.time()
        for r in range(self.world_size):
            key = f"{self.namespace}/status/{r}"
            try:
                if not self.client.check([key], deadline):
                    lines.append(f"  rank {r}: no shardsafe call seen yet")
                    continue
                s = json.loads(self.client.get(key, deadline))
                lines.append(
                    f"  rank {r}: {s['op']}({s['target']!r}) #{s['seq']} in phase {s['phase']!r} for "
                    f"{now - s['since']:.1f}s"
                )
            except (CheckpointError, ValueError, KeyError, TypeError):
                lines.append(f"  rank {r}: unknown (store unreachable)")
        return lines

    # ------------------------------------------------------------------------------ the end

    def acknowledge(self) -> list[int]:
        """(every rank, once it has read the operation's outcome) Say so. Rank 0 waits until every other
        rank has said so or is dead (its heartbeat stopped), within the call's end (at most the arrival
        budget from now), and returns the ranks that did neither (after a WARNING): a script that ends
        the process hosting the store right after the call strands nobody."""
        if self.single:
            return []
        assert self.client is not None
        bound = self.clock.end.or_grace().within(self.clock.budget.arrive, "acknowledge")
        count, every = self.key("ack", "n"), self.key("ack", "all")
        self.used.add("ack")
        if self.rank != 0:
            try:
                if self.client.add(count, 1, bound, self.tally) == self.world_size - 1:
                    self.client.set(every, "1", bound, self.tally)
            except RankDeadError as err:  # the store is gone: nobody is left to tell
                logger.debug("shardsafe: rank %d could not acknowledge %s: %s", self.rank, self.op, err)
            return []
        excused: set[int] = set()

        def excuse(ranks: list[int], _silent: float) -> None:
            assert self.client is not None
            for r in ranks:
                if r not in excused:
                    excused.add(r)
                    if self.client.add(count, 1, bound) == self.world_size - 1:
                        self.client.set(every, "1", bound)

        others = list(range(1, self.world_size))
        watch = Watch(lambda: others, excuse)
        assert self.dog is not None
        self.dog.watch(watch)
        try:
            got = self.client.wait_value(every, bound, tally=self.tally, wake=watch.wake)
        except RankDeadError as err:
            logger.warning(
                "shardsafe: %s of %s is done, but the store went away before every rank confirmed: %s",
                self.op,
                self.target,
                err,
            )
            return others
        finally:
            self.dog.unwatch(watch)
        if got is not None:
            return sorted(excused)
        logger.warning(
            "shardsafe: %s of %s is done, but some ranks did not confirm they read the outcome within %.0fs; "
            "returning anyway. If this process ends now and hosts the rendezvous store, those ranks may raise "
            "RankDeadError (a committed checkpoint stays committed).",
            self.op,
            self.target,
            bound.seconds,
        )
        return others

    def conclude(self, body: Callable[[], T]) -> T:
        """(every rank) Run ``body`` (the operation's agreements and work), acknowledge the outcome it
        read (also when it raised, once an outcome was read: every rank got the same one, and rank 0
        may be waiting for the acknowledgements) and :meth:`close`. Returns what ``body`` returns."""
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
        if self.dog is not None:
            assert self.client is not None
            try:
                self.dog.deactivate()
            finally:
                self.client.release()

    def clean_previous(self) -> None:
        """(rank 0, once every rank has arrived at this operation, so none reads the channel's earlier
        ones any more) Post the deletion of the keys of the channel's previous operations."""
        if self.rank != 0 or self.single or self.client is None:
            return
        deadline = Deadline.after(knobs.error_report_seconds(), "housekeeping")
        for seq in sorted(k[2] for k in list(_used) if k[:2] == (self.identity, self.prefix) and k[2] < self.seq):
            phases = _used.pop((self.identity, self.prefix, seq), set())
            base = f"{self.prefix}/{seq}"
            names = [f"{base}/present", f"{base}/decision"]
            for phase in phases:
                if phase == "ack":
                    names += [f"{base}/ack/n", f"{base}/ack/all"]
                elif phase == "progress":
                    names += [f"{base}/progress/r/{r}" for r in range(self.world_size)]
                else:
                    names += [f"{base}/{phase}/{leaf}" for leaf in ("m", "n", "ready", "outcome")]
            try:
                for name in names:
                    self.client.delete(name, deadline)
            except CheckpointError as err:  # housekeeping only: keys of a finished operation are inert
                logger.debug("shardsafe: could not delete the keys of %s: %s", base, err)


def rendezvous(op: str, target: str, budget: Deadlines, *, match_site: bool = False, group: Any = None) -> None:
    """(every rank) An operation that is only its first agreement: every rank reaches this point (within
    the arrival budget) doing the same thing (``op``, ``target``, and with ``match_site`` the same call
    site), else every rank raises (:class:`RankTimeoutError`, :class:`RankDesyncError`)."""
    meeting = Operation.begin(op, target, budget.start(), group=group, match_site=match_site)
    try:
        meeting.agree("arrive", None)
    finally:
        meeting.close()
