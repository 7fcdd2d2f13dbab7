"""The node-local tier's save and resume protocols (docs/tiers.md). Every rank calls them; the ranks
talk through :class:`~shardsafe.coord.Operation` agreements (the rendezvous store), never collectives.

Local save of step N (operation ``tier.save``):

1. agreement ``arrive``: each rank sends its node, replica-server address and token; rank 0 returns the table;
2. each rank saves its whole state as a one-process shardsafe checkpoint ``<node folder>/step-N/rank-R``
   (all-or-nothing by itself), then pushes it to its peers (:func:`~shardsafe.manager.tiers.peers`),
   each of which verifies every byte before the copy counts;
3. agreement ``done``: every rank's outcome; any failure is raised on every rank. Only after it does a
   rank apply retention, so the steps it deletes are older than one that every rank completed.

Resume (operation ``tier.resume``): agreement ``scan``: each rank verifies the entries it owns in its
node folder and reports them; rank 0 finds the steps newer than the durable store's newest for which
every rank's share verifies somewhere (its own copy or a replica) and picks, for each rank, where its
share comes from. Per candidate, newest first: each rank fetches its share from a peer when its own is
missing or damaged (every byte verified), agreement ``fetch.<n>``; then each loads its own share,
agreement ``load.<n>``. The first candidate every rank loaded wins; none: the durable store."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, MutableMapping
from typing import Any

from shardsafe.coord import Deadline, Deadlines, Operation
from shardsafe.coord.resolve import SOLO
from shardsafe.engine import api
from shardsafe.errors import CheckpointError, CorruptCheckpointError, RemoteRankError
from shardsafe.manager import replica
from shardsafe.manager.messages import (
    TIER_ARRIVE,
    TIER_DONE,
    TIER_FETCH,
    TIER_LOAD,
    TIER_SCAN,
    Held,
    Holdings,
    Peer,
    Table,
    TierCandidate,
    TierPlan,
    collect,
    peer_table,
)
from shardsafe.manager.resume import _attempt, _outcome
from shardsafe.manager.tiers import (
    REPLICA_RE,
    SHARE_RE,
    LocalTier,
    drop_newer,
    drop_old,
    node_identity,
    share_name,
    step_name,
    steps_in,
)

logger = logging.getLogger(__name__)


class LocalTierRuntime:
    """(every rank) The local tier of one manager: its folder, replica server and protocols."""

    def __init__(self, tier: LocalTier, rank: int, world_size: int, timeout: float | None) -> None:
        self.tier = tier
        self.rank = rank
        self.world_size = world_size
        self.node = node_identity()
        self.folder = tier.folder(self.node)
        self.timeout = timeout
        self.deadlines = Deadlines.resolve(timeout)
        os.makedirs(self.folder, exist_ok=True)
        self.server = replica.ReplicaServer(self.folder, rank, replica.own_host())
        self.table: Table | None = None

    def close(self) -> None:
        self.server.close()

    def _me(self) -> Peer:
        return Peer(self.node, self.server.address, self.server.token)

    # ------------------------------------------------------------------------------------ save

    def save(self, step: int, state: Mapping[str, Any], durable: int | None) -> None:
        """(every rank) Save ``state`` as this rank's share of ``step`` and replicate it; returns once
        every rank's share and replicas are in place, else raises on every rank. Then retention
        (``durable``: the newest durable step, whose older local copies are dropped)."""
        op = Operation.begin("tier.save", self.tier.path_template, self.deadlines.start())

        def agree_on_the_step() -> Table:
            table = self.table = op.agree(TIER_ARRIVE, self._me(), peer_table)
            error: Exception | None = None
            try:
                path = os.path.join(self.folder, step_name(step), share_name(self.rank))
                meta = {"step": step, "rank": self.rank, "world_size": self.world_size}
                api.save(path, state, group=SOLO, overwrite=True, timeout=self.timeout, metadata=meta)
                deadline = Deadline.after(self.deadlines.io, "io")
                for p in table.peers(self.rank, self.tier.replicas):
                    replica.push(table.addresses[p], table.tokens[p], path, step, self.rank, deadline)
            except Exception as err:  # shared with every rank below
                error = err

            outcomes = op.agree(TIER_DONE, _outcome(error), collect).attempts
            failed = [(r, o) for r, o in enumerate(outcomes) if not o.ok]
            if failed:
                if error is not None:
                    raise error
                r, o = failed[0]
                raise RemoteRankError(
                    f"local-tier save of step {step} failed on rank {r}: {o.error}. Its earlier local steps are "
                    "intact.",
                    rank=r,
                    phase="tier.save",
                    cause=o.error,
                )
            return table

        table = op.conclude(agree_on_the_step)
        drop_old(
            self.folder,
            self.rank,
            table.senders(self.rank, self.tier.replicas),
            self.tier.keep,
            durable,
            step,
        )

    # ---------------------------------------------------------------------------------- resume

    def _report(self, senders: list[int]) -> Holdings:
        """This rank's verified entries, by step: its own share and the replicas of ``senders`` (the
        ranks whose replicas it receives), each read whole."""
        out: dict[str, Held] = {}
        for step in steps_in(self.folder):
            where = os.path.join(self.folder, step_name(step))
            own = False
            held: list[int] = []
            try:
                names = sorted(os.listdir(where))
            except FileNotFoundError:
                continue
            for n in names:
                share, rep = SHARE_RE.match(n), REPLICA_RE.match(n)
                if share and int(share.group(1)) == self.rank:
                    own = _verifies(os.path.join(where, n), step, self.rank, self.world_size)
                elif rep and (sender := int(rep.group(1))) in senders:
                    held += [sender] if _verifies(os.path.join(where, n), step, sender, self.world_size) else []
            out[str(step)] = Held(own, held)
        return Holdings(out)

    def resume(self, state: MutableMapping[str, Any], durable: int | None) -> int | None:
        """(every rank) Load the newest local step newer than ``durable`` that is complete across the
        nodes into ``state`` and return it; ``None`` (state untouched unless a candidate failed to
        load, then the caller's durable resume overwrites it) when there is none."""
        op = Operation.begin("tier.resume", self.tier.path_template, self.deadlines.start())
        return op.conclude(lambda: self._resume(op, state, durable))

    def _resume(self, op: Operation, state: MutableMapping[str, Any], durable: int | None) -> int | None:
        table = self.table = op.agree(TIER_ARRIVE, self._me(), peer_table)
        senders = table.senders(self.rank, self.tier.replicas)
        mine = self._report(senders)

        def plan(holdings: dict[int, Holdings]) -> TierPlan:
            return TierPlan(_plan([holdings[r] for r in range(len(holdings))], durable))

        candidates = op.agree(TIER_SCAN, mine, plan).candidates
        deadlines = self.deadlines
        for n, candidate in enumerate(candidates):
            step, sources = candidate.step, candidate.sources
            source = sources[self.rank]
            path = os.path.join(self.folder, step_name(step), share_name(self.rank))

            def fetch(step: int = step, source: int = source) -> None:
                if source == self.rank:
                    return
                try:
                    replica.pull(
                        table.addresses[source],
                        table.tokens[source],
                        self.folder,
                        step,
                        self.rank,
                        Deadline.after(deadlines.io, "io"),
                    )
                except (CheckpointError, OSError) as err:  # this step cannot be had: an older one is tried
                    raise CorruptCheckpointError(
                        f"rank {self.rank}: its share of local step {step} is missing or damaged and fetching "
                        f"the replica from rank {source} failed: {err}"
                    ) from err

            def load(path: str = path) -> None:
                api.load(path, state, group=SOLO, timeout=self.timeout, rest="none")

            why = _attempt(op, TIER_FETCH.nth(n), "fetch", fetch, path, deadlines)
            if why is None:
                why = _attempt(op, TIER_LOAD.nth(n), "load", load, path, deadlines)
            if why is None:
                if op.rank == 0:
                    moved = sorted({r for r, s in enumerate(sources) if s != r})
                    logger.info(
                        "shardsafe: resumed from the local tier, step %d%s",
                        step,
                        f" (the shares of ranks {moved} from their replicas)" if moved else "",
                    )
                drop_newer(self.folder, self.rank, senders, step)
                return int(step)
            if op.rank == 0:
                logger.warning("shardsafe: local step %d could not be resumed: %s; trying an older one", step, why)
        return None

    def forget_newer(self, step: int | None) -> None:
        """(every rank, after a durable resume to ``step``) Remove local steps newer than it."""
        senders = self.table.senders(self.rank, self.tier.replicas) if self.table is not None else []
        drop_newer(self.folder, self.rank, senders, step)


def _verifies(path: str, step: int, rank: int, world_size: int) -> bool:
    """Whether the local checkpoint at ``path`` is committed, every byte matches its checksums, and it
    is the share of ``rank`` of ``step`` in a job of ``world_size`` ranks (a job of another size, or a
    misplaced folder, never counts)."""
    try:
        api.verify(path)
        meta = api.inspect(path).metadata
    except (CheckpointError, OSError, EOFError) as err:
        logger.warning("shardsafe: local-tier copy %s is not usable: %s", path, err)
        return False
    want = {"step": step, "rank": rank, "world_size": world_size}
    if meta != want:
        logger.warning("shardsafe: local-tier copy %s is not usable: its metadata is %r, not %r", path, meta, want)
        return False
    return True


def _plan(reports: list[Holdings], durable: int | None) -> list[TierCandidate]:
    """(rank 0) The steps newer than ``durable`` (newest first) for which every rank's share verifies
    on its own node or as a replica, each with the rank that provides each rank's share."""
    world = len(reports)
    steps = sorted({int(s) for rep in reports for s in rep.steps}, reverse=True)
    out: list[TierCandidate] = []
    for step in steps:
        if durable is not None and step <= durable:
            continue
        sources: list[int] = []
        for r in range(world):
            entry = reports[r].steps.get(str(step))
            if entry is not None and entry.own:
                sources.append(r)
                continue
            holder = next((p for p in range(world) if r in _held(reports[p], step)), None)
            if holder is None:
                break
            sources.append(holder)
        if len(sources) == world:
            out.append(TierCandidate(step, sources))
    return out


def _held(report: Holdings, step: int) -> list[int]:
    """The ranks whose replicas of ``step`` the rank of ``report`` holds, verified."""
    entry = report.steps.get(str(step))
    return [] if entry is None else entry.replicas
