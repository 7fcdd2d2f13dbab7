"""All cross-rank talk of shardsafe: rendezvous, barriers, broadcasts, deadlines and error propagation,
through the rendezvous store (``torch.distributed.Store``), never through collectives of the training
process group. With no process group (one process) every call is local and immediate.

One :class:`Coordinator` serves one operation (a save, a load, a runtime barrier). Operations are
matched across ranks by a per-process sequence number per channel: ``ckpt`` for saves and loads,
``misc`` for everything else. Within a channel a process runs one operation at a time (a save or load
first waits for the save in flight), which is what lets rank 0 delete the keys of earlier operations
of the channel once every rank has reached a later one; an async save's background phases are never
cleaned away by a runtime barrier or a manager decision taken meanwhile. Every decision is settled by the first writer
of a ``compare_set`` on a decision key, so a late rank, a failing rank and a timing-out rank can never
disagree on the outcome. An operation abandoned on timeout is skipped by ranks that arrive late, so a
later operation called by every rank still meets (no poisoned state).

Store layout under ``shardsafe/<group>/<channel>/`` (``status`` directly under ``shardsafe/<group>/``)::

    <seq>/arrive/r/<rank>      arrival record: op, target, call site, host, pid
    <seq>/arrive/count         arrivals so far (store.add)
    <seq>/arrive/decision      "go" or a timeout record (first compare_set wins)
    <seq>/<phase>/...          the same three keys for each barrier of the operation
    <seq>/<phase>/value        a broadcast value
    <seq>/abort                the first failure of the operation: rank, phase, error
    <seq>/decision             the operation's outcome ("commit" or an abort record): first compare_set wins
    <seq>/<name>               a value one rank posts for the others (e.g. ``published``)
    <seq>/ack/<rank>           the rank has read the outcome (rank 0 returns only after every live one)
    <seq>/hb/<rank>            heartbeat counter of a rank inside the operation (save, load)
    <seq>/done                 ranks that have left the operation (close)
    status/<rank>              where the rank is now (for stall and timeout reports)

Store traffic goes through shardsafe's own connection to the store where it can
(:mod:`shardsafe.coord.connection`), so another thread blocked in ``store.get`` on the process
group's client never stalls a heartbeat or a wait.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import Any

from torch._C._distributed_c10d import Store

from shardsafe.coord.connection import preferred
from shardsafe.coord.deadlines import Deadlines
from shardsafe.coord.failures import Failures
from shardsafe.coord.housekeeping import Housekeeping, _seq, _seq_lock
from shardsafe.coord.outcome import Outcome
from shardsafe.coord.resolve import call_site, channel_of, resolve_group
from shardsafe.coord.waiting import wait_until
from shardsafe.errors import InvalidArgumentError, RankDeadError, RankDesyncError

logger = logging.getLogger(__name__)

_GO = "go"


class Coordinator(Failures, Housekeeping, Outcome):
    """Cross-rank talk for one operation. Create with :meth:`join` on every rank of the group. Store
    access and diagnostics live in :mod:`~shardsafe.coord.access`, heartbeats in
    :mod:`~shardsafe.coord.liveness`, decisions and acknowledgements in :mod:`~shardsafe.coord.outcome`,
    abort records in :mod:`~shardsafe.coord.failures`, key cleanup in :mod:`~shardsafe.coord.housekeeping`,
    group resolution in :mod:`~shardsafe.coord.resolve`, the one wait loop in :mod:`~shardsafe.coord.waiting`."""

    def __init__(
        self,
        store: Store | None,
        rank: int,
        world_size: int,
        namespace: str,
        op: str,
        target: str,
        deadlines: Deadlines,
        global_rank: int,
    ) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.global_rank = global_rank
        self.namespace = namespace  # the group's: status keys live here
        self.prefix = f"{namespace}/{channel_of(op)}"  # the operation's keys live here
        self.op = op
        self.target = target
        self.deadlines = deadlines
        self.seq = 0
        self.identity = 0
        self._hb_stop: threading.Event | None = None
        self._hb_seen: dict[int, tuple[int, float]] = {}
        self._hb_checked = 0.0
        self._hb_error: BaseException | None = None
        self._finishing = False  # the outcome is read: a store that vanishes now is no news
        self._closed = False
        self._local_decision: str | None = None  # the outcome without a store (one process)
        self._shared: Store | None = store  # the process group's own client (heartbeat fallback)
        self.infos: list[dict[str, Any]] = []

    # ----------------------------------------------------------------------------------- joining

    @classmethod
    def join(
        cls,
        op: str,
        target: str,
        *,
        deadlines: Deadlines,
        group: Any = None,
        store: Store | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        match_site: bool = False,
        extra: dict[str, Any] | None = None,
        heartbeat: bool = False,
    ) -> Coordinator:
        """(all ranks) Rendezvous for operation ``op`` on ``target``.

        Waits up to ``deadlines.arrive`` for every rank; raises :class:`RankTimeoutError` naming the
        ranks that never came, and :class:`RankDesyncError` on every rank when ranks arrived doing
        different things (another op or target; another call site when ``match_site``).
        With ``heartbeat`` each rank ticks a store counter until :meth:`close`, and waits declare a
        rank dead (:class:`RankDeadError`) once its counter stops for ``SHARDSAFE_DEAD_AFTER`` seconds,
        instead of waiting for the deadline. Whoever passes ``heartbeat=True`` must call ``close()``.
        The group comes from ``store``/``rank``/``world_size`` when given, else from ``group`` or the
        default process group, else it is a single process.
        """
        if store is None:
            store, rank, world_size, global_rank, ns, identity = resolve_group(group)
        else:
            if rank is None or world_size is None:
                raise InvalidArgumentError("Coordinator.join(store=...) also needs rank= and world_size=")
            global_rank, ns, identity = rank, f"shardsafe/custom{world_size}", id(store)
        assert rank is not None and world_size is not None
        self = cls(store, rank, world_size, ns, op, target, deadlines, global_rank)
        self.identity = identity
        if store is not None and world_size > 1:  # fixed for the operation: one connection keeps its order
            self.store = preferred(store, identity)
        site = call_site()
        info = {"op": op, "target": target, "site": site, "host": socket.gethostname(), "pid": os.getpid()}
        info.update(extra or {})
        if store is None or world_size == 1:
            self.infos = [info]
            return self
        self._arrive(info, match_site)
        if heartbeat:
            self._start_heartbeat()
        return self

    def _arrive(self, info: dict[str, Any], match_site: bool) -> None:
        key = (self.identity, self.prefix)
        started = time.monotonic()
        while True:
            with _seq_lock:
                self.seq = _seq.get(key, 0) + 1
                _seq[key] = self.seq
            self._status("arrive")
            self._use("arrive")
            self._set(self._k("arrive", "r", str(self.rank)), json.dumps(info))
            if self._add(self._k("arrive/count"), 1) == self.world_size:
                self._compare_set(self._k("arrive/decision"), _GO)
            remaining = self.deadlines.arrive - (time.monotonic() - started)
            decision = self._await_decision("arrive", max(remaining, 0.0), watch_abort=False)
            if decision == _GO:
                break
            record = json.loads(decision)
            if self.rank in record["arrived"]:
                raise self._timeout_error("arrive", record["missing"], self.deadlines.arrive)
            # Late for an operation the others abandoned: skip it, meet them at the next one.
            logger.warning(
                "shardsafe: rank %d arrived at %s %s after ranks %s gave up waiting (they timed out); "
                "moving on to the next operation",
                self.rank,
                self.op,
                self.target,
                record["arrived"],
            )
        self.infos = [json.loads(v) for v in self._get_all("arrive")]
        self._cleanup_previous(key)
        fields = ("op", "target", "site") if match_site else ("op", "target")
        if any(tuple(i[f] for f in fields) != tuple(self.infos[0][f] for f in fields) for i in self.infos):
            lines = "\n".join(
                f"  rank {r}: {i['op']}({i['target']!r}) called at {i['site']}" for r, i in enumerate(self.infos)
            )
            raise RankDesyncError(
                f"ranks are out of step: they met at the same point doing different things:\n{lines}\n"
                "Every rank must make the same shardsafe calls in the same order (same path, same call "
                "site); look for a rank-dependent branch before these lines."
            )

    # ---------------------------------------------------------------------------------- barriers

    def barrier(self, phase: str, payload: str = "", *, timeout: float, collect: bool = False) -> list[str]:
        """(all ranks) Post ``payload`` and wait until every rank has. Returns every rank's payload,
        in rank order, when ``collect`` (else ``[]``). Raises :class:`RemoteRankError` as soon as any
        rank reports a failure (:meth:`fail`), :class:`RankTimeoutError` at the deadline."""
        if self.store is None or self.world_size == 1:
            return [payload] if collect else []
        self._status(phase)
        self._use(phase)
        self._set(self._k(phase, "r", str(self.rank)), payload)
        if self._add(self._k(phase, "count"), 1) == self.world_size:
            self._compare_set(self._k(phase, "decision"), _GO)
        decision = self._await_decision(phase, timeout, watch_abort=True)
        if decision != _GO:
            record = json.loads(decision)
            raise self._timeout_error(phase, record["missing"], timeout, by=record["by"])
        return self._get_all(phase) if collect else []

    def broadcast(self, phase: str, value: str | None, *, src: int = 0, timeout: float) -> str:
        """(all ranks) ``src`` passes the value, the others get it; failures and deadlines as in
        :meth:`barrier`."""
        if self.store is None or self.world_size == 1:
            assert value is not None
            return value
        self._status(phase)
        self._use(phase)
        key = self._k(phase, "value")
        if self.rank == src:
            assert value is not None
            self._set(key, value)
            return value

        def watch() -> bool:
            self._raise_if_heartbeat_failed()
            failure = self.remote_failure()
            if failure is not None:
                if self._check(key):  # the value came first (e.g. a commit record, then a later failure)
                    return True
                raise failure
            self._check_alive(phase, [src])
            return False

        def stalled(elapsed: float) -> None:
            self._warn_stall(phase, f"rank {src}'s {phase} record", [src], elapsed, timeout)

        if not wait_until(lambda: self._check(key), timeout=timeout, watch=watch, stalled=stalled):
            raise self._timeout_error(phase, [src], timeout)
        return self._get(key)

    # ------------------------------------------------------------------------------- internals

    def close(self) -> None:
        """(every rank that joined with ``heartbeat``) Stop ticking and record that the operation is
        over on this rank (rank 0 then may delete its keys). Idempotent."""
        if self._hb_stop is None or self._closed:
            return
        self._closed = self._finishing = True
        self._hb_stop.set()
        try:
            self._add(self._k("done"), 1)
        except RankDeadError as err:  # the store is gone: nothing left to clean up there
            logger.debug("shardsafe: could not record the end of %s on rank %d: %s", self.op, self.rank, err)

    def _await_decision(self, phase: str, timeout: float, *, watch_abort: bool) -> str:
        key = self._k(phase, "decision")

        def watch() -> bool:
            self._raise_if_heartbeat_failed()
            if watch_abort:
                self._raise_if_aborted()
                if self._hb_stop is not None:
                    # rank 0 watches every rank and its abort tells the rest; the others watch rank 0
                    watched = [r for r in range(self.world_size) if r != self.rank] if self.rank == 0 else [0]
                    self._check_alive(phase, watched)
            return False

        def stalled(elapsed: float) -> None:
            missing = [r for r in range(self.world_size) if not self._check(self._k(phase, "r", str(r)))]
            self._warn_stall(phase, f"every rank to reach {phase!r}", missing, elapsed, timeout)

        if wait_until(lambda: self._check(key), timeout=timeout, watch=watch, stalled=stalled):
            return self._get(key)
        arrived = [r for r in range(self.world_size) if self._check(self._k(phase, "r", str(r)))]
        missing = [r for r in range(self.world_size) if r not in arrived]
        record = json.dumps({"kind": "timeout", "by": self.rank, "arrived": arrived, "missing": missing})
        decided = self._compare_set(key, record)
        if watch_abort and decided != _GO:
            self._compare_set(
                self._k("abort"),
                json.dumps(
                    {"rank": self.global_rank, "phase": phase, "error": f"timed out waiting for ranks {missing}"}
                ),
            )
        return decided
