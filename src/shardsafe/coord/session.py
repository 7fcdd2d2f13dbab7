"""The state of one operation on one rank: who takes part (rank, world, the store client, the watchdog),
which keys it uses, where this rank is, and the request tally. No protocol here: the rounds that run
on it are :mod:`shardsafe.coord.wire` (keys and requests of one round) and the engine,
:class:`~shardsafe.coord.operation.Operation`.

Operations are matched across ranks by a per-process sequence number per channel (``ckpt`` for saves
and loads, so that a save meeting a load is caught as out of step; ``misc`` for everything else).
Within a channel a process runs one operation at a time, so once every rank has arrived at an
operation, the keys of the ones before it are no longer read by anyone: rank 0 deletes them then
(posted deletes, not waited for), and a long run leaves nothing behind.

Store layout under ``shardsafe/<group>/``::

    <channel>/<seq>/<phase>/{m,n,ready,outcome}   one round (see wire.py)
    <channel>/<seq>/<phase>/decision              a commitment's go or abort: the first compare_set wins
    <channel>/<seq>/present                       rank 0 is inside the operation (its watchers start then)
    <channel>/<seq>/ack/{n,all}                   acknowledgements: rank 0 returns after every live rank's
    <channel>/<seq>/counters/<name>/<rank>        a rank's counter record (counters.py)
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

from shardsafe import knobs
from shardsafe.coord.client import StoreClient, Tally
from shardsafe.coord.failures import Failure
from shardsafe.coord.liveness import Watchdog, watchdog_for
from shardsafe.coord.messages import Arrival
from shardsafe.coord.resolve import call_site
from shardsafe.deadline import Clock, Deadline
from shardsafe.errors import CheckpointError

logger = logging.getLogger(__name__)

STATUS_LINES = 16
"""At most this many ranks' status lines in a stall or timeout report (at thousands of ranks, reading every
rank's line would be thousands of requests from every waiting rank)."""

_seq_lock = threading.Lock()
_seq: dict[tuple[int, str], int] = {}
_used: dict[tuple[int, str, int], dict[str, tuple[str, ...]]] = {}  # (identity, prefix, seq) -> keys rank 0 used
_open: dict[tuple[int, str], set[int]] = {}  # (identity, prefix) -> sequences this process began and not closed
LAST_TALLY: dict[str, Tally] = {}
"""The request tally of the last operation of each kind in this process (``"save"``, ``"load"``...);
read by the round-trip test and the protocol-cost bench."""


class Session:
    """One operation on this rank (module docstring); made by
    :meth:`Operation.begin <shardsafe.coord.operation.Operation.begin>`."""

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
        channel: str,
    ) -> None:
        self.op = op
        self.target = target
        self.clock = clock
        self.client = client
        self.rank = rank
        self.world_size = world_size
        self.global_rank = global_rank
        self.namespace = namespace
        self.prefix = f"{namespace}/{channel}"
        self.identity = identity
        self.match_site = match_site
        self.single = client is None or world_size == 1
        self.dog: Watchdog | None = None if client is None or self.single else watchdog_for(client, namespace, rank)
        self.tally = Tally()
        self.seq = 0
        self.used: dict[str, tuple[str, ...]] = {}
        self.arrived_all = False
        self.first_phase = ""
        self.arrival = Arrival(op, target, call_site(), socket.gethostname(), os.getpid())
        self.arrivals: list[Arrival] = [self.arrival]
        self.own_decided: CheckpointError | None = None
        """This rank's own error that it decided for everyone (rank 0): raised as it is."""
        self.outcome_known = False
        self.closed_below = 0
        """(rank 0, from the arrivals) Every rank has closed this channel's operations older than this."""
        """True once this rank read an outcome that says the operation failed (it raises that)."""
        self._present = False

    def next_sequence(self) -> None:
        """Take this channel's next sequence number (also to skip an operation the others abandoned)."""
        key = (self.identity, self.prefix)
        with _seq_lock:
            opened = _open.setdefault(key, set())
            opened.discard(self.seq)  # an operation the others abandoned: this rank is done with it
            self.seq = _seq.get(key, 0) + 1
            _seq[key] = self.seq
            opened.add(self.seq)
        self.used = {}
        if self.rank == 0:
            _used[(self.identity, self.prefix, self.seq)] = self.used
        self._present = False

    def finished(self) -> None:
        """(the operation closing on this rank) This rank reads none of its keys any more."""
        with _seq_lock:
            _open.get((self.identity, self.prefix), set()).discard(self.seq)

    def oldest_open(self) -> int:
        """The oldest sequence of this channel that this process still has open (this operation's, or an
        earlier one still running: an asynchronous save in flight); sent with the arrival."""
        with _seq_lock:
            return min(_open.get((self.identity, self.prefix), set()) | {self.seq})

    def key(self, *parts: str) -> str:
        return "/".join((self.prefix, str(self.seq), *parts))

    def use(self, under: str, leaves: tuple[str, ...]) -> None:
        """Record that this operation uses the keys ``<under>/<leaf>`` (rank 0 deletes them later)."""
        self.used[under] = tuple(dict.fromkeys((*self.used.get(under, ()), *leaves)))

    # ------------------------------------------------------------------------------ presence

    def announce_leader(self, deadline: Deadline) -> None:
        """(rank 0, its first round) Say that rank 0 is inside the operation (its watchers start then)."""
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

    # ------------------------------------------------------------------------------ failures

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

    # ------------------------------------------------------------------------------ status

    def status(self, phase: str) -> None:
        """(every rank) Post where this rank is (read only by stall and timeout reports)."""
        if self.single:
            return
        assert self.client is not None
        record = json.dumps(
            {"op": self.op, "target": self.target, "seq": self.seq, "phase": phase, "since": time.time()}
        )
        self.client.set(f"{self.namespace}/status/{self.rank}", record, self.clock.end.or_grace(), self.tally)

    def status_lines(self, deadline: Deadline, ranks: list[int]) -> list[str]:
        """Where the ranks ``ranks`` were last, one line each, at most :data:`STATUS_LINES` of them (the
        rest counted): two requests a rank, all within ``deadline``, a diagnostic's. Its requests going
        unanswered say nothing about the operation: once it has passed, the remaining ranks are "unknown"
        without a request (at thousands of ranks, every waiting rank asking for every rank's line would
        itself overload the store)."""
        if self.single or self.client is None:
            return [f"  rank 0: {self.op}({self.target!r})"]
        named = list(dict.fromkeys(r for r in ranks if 0 <= r < self.world_size))
        lines = []
        now = time.time()
        for r in named[:STATUS_LINES]:
            key = f"{self.namespace}/status/{r}"
            if deadline.expired():
                lines.append(f"  rank {r}: unknown (the store did not answer in time)")
                continue
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
                lines.append(f"  rank {r}: unknown (the store did not answer in time)")
        if len(named) > STATUS_LINES:
            lines.append(f"  ({len(named) - STATUS_LINES} more ranks not shown)")
        return lines

    # ------------------------------------------------------------------------------ housekeeping

    def clean_previous(self) -> None:
        """(rank 0, once every rank has arrived at this operation) Post the deletion of the keys of the
        channel's earlier operations that every rank has closed: those older than the oldest that any
        rank still had open when it arrived (:attr:`closed_below`; an asynchronous save in flight may still
        read its keys while the next operation begins)."""
        if self.rank != 0 or self.single or self.client is None:
            return
        deadline = Deadline.after(knobs.error_report_seconds(), "housekeeping")
        below = min(self.seq, self.closed_below)
        for seq in sorted(k[2] for k in list(_used) if k[:2] == (self.identity, self.prefix) and k[2] < below):
            used = _used.pop((self.identity, self.prefix, seq), {})
            base = f"{self.prefix}/{seq}"
            names = [
                f"{base}/present",
                *(f"{base}/{under}/{leaf}" for under, leaves in used.items() for leaf in leaves),
            ]
            try:
                for name in names:
                    self.client.delete(name, deadline)
            except CheckpointError as err:  # housekeeping only: keys of a finished operation are inert
                logger.debug("shardsafe: could not delete the keys of %s: %s", base, err)
