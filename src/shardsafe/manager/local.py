"""The node-local tier's save and resume protocols (docs/tiers.md). Every rank calls them; the ranks
talk through :class:`~shardsafe.coord.Operation` agreements (the rendezvous store), never collectives.

Local save of step N (operation ``tier.save``):

1. agreement ``arrive``: each rank sends its node, replica-server address and token; rank 0 decides the
   table, the run (manager/lineage.py: the recorded one, else a new one), the incarnation and a new save
   id;
2. each rank saves its whole state as a one-process shardsafe checkpoint
   ``<node folder>/run-<run>/step-N-<save>/rank-R`` (all-or-nothing by itself; its metadata names its
   step, rank, number of ranks, run, save and incarnation), then pushes it to its peers
   (:func:`~shardsafe.manager.tiers.peers`), each of which verifies every byte and the metadata before
   the copy counts;
3. agreement ``done``: every rank's outcome; when all succeeded and the run record does not list this
   job's incarnation yet, rank 0 records it before deciding (a failure to record is a failure of the
   save: its shares never count). A failure is every rank's (:class:`LocalFailure`); only after a success
   does a rank apply retention, so the steps it deletes are older than one that every rank completed.

Resume (operation ``tier.resume``): agreement ``arrive`` (the table, and the run, which rank 0 reads
from the durable root); agreement ``scan``: each rank verifies the entries of the run in its node folder
that it handles (:func:`~shardsafe.manager.tiers.handler`: by the rank an entry names, among the ranks
of the node now) and reports them; rank 0 groups the copies by save and keeps the saves newer than the
durable store's newest, of an incarnation the run record still counts, with a verified copy of every
rank's share; for each, newest first, it picks where each rank's share comes from (its node's folder,
else a peer). Per candidate: each rank fetches its share from a peer when its node holds none (every byte
verified), agreement ``fetch.<n>``; only then does any rank load, agreement ``load.<n>``. The first
candidate every rank loaded wins; none: the durable store.

Then (operation ``tier.begin``, agreement ``record``) rank 0 records this job as a new incarnation that
resumed from the step chosen (local or durable), and each rank deletes what it handles of the newer steps
(failures logged: an entry that stays never counts again)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, replace
from typing import Any

from shardsafe.coord import Clock, Deadline, Deadlines, Operation
from shardsafe.coord.messages import Empty
from shardsafe.coord.resolve import SOLO, resolve_group
from shardsafe.engine import api
from shardsafe.errors import CheckpointError, CheckpointTimeoutError, CorruptCheckpointError, RemoteRankError
from shardsafe.manager import replica
from shardsafe.manager.lineage import RunRecord, read_record, record_path, write_record
from shardsafe.manager.messages import (
    TIER_ARRIVE,
    TIER_DONE,
    TIER_FETCH,
    TIER_LOAD,
    TIER_RECORD,
    TIER_RESUME_ARRIVE,
    TIER_SCAN,
    Attempt,
    Attempts,
    Copies,
    Peer,
    Recorded,
    Table,
    TierPlan,
    TierStart,
    TierTable,
    collect,
    peer_table,
)
from shardsafe.manager.resume import _attempt, _outcome
from shardsafe.manager.tiers import (
    REPLICA_RE,
    SHARE_RE,
    LocalTier,
    foreign,
    forget,
    handler,
    new_run_id,
    new_save_id,
    node_identity,
    real_dir,
    retain,
    run_name,
    saves_in,
    share_name,
    step_folder,
    step_name,
    warn_once,
)
from shardsafe.storage import Storage
from shardsafe.workers import run_bounded

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalFailure:
    """A local save that failed, on every rank: the rank it failed on (this one, when its own part
    failed; else the first), that rank's account (its node, folder and error), and this rank's own
    error when it is one of them."""

    rank: int
    message: str
    own: Exception | None

    def error(self, step: int) -> Exception:
        """What :meth:`CheckpointManager.save_local` raises: this rank's own error, else a
        :class:`RemoteRankError` naming the rank."""
        if self.own is not None:
            return self.own
        return RemoteRankError(
            f"local-tier save of step {step} failed on {self.message}. Its earlier local steps are intact.",
            rank=self.rank,
            phase="tier.save",
            cause=self.message,
        )


class LocalTierRuntime:
    """(every rank) The local tier of one manager: its folder, replica server and protocols. ``fs`` and
    ``root``: the durable store, where the run is recorded (rank 0 reads and writes it)."""

    def __init__(
        self, tier: LocalTier, rank: int, world_size: int, timeout: float | None, fs: Storage, root: str
    ) -> None:
        self.tier = tier
        self.rank = rank
        self.world_size = world_size
        self.node = node_identity()
        self.folder = tier.folder(self.node)
        self.timeout = timeout
        self.deadlines = Deadlines.resolve(timeout)
        self.fs = fs
        self.root = root
        os.makedirs(self.folder, exist_ok=True)
        self.server = replica.ReplicaServer(self.folder, rank, replica.own_host(resolve_group(None)[0]))
        self.table: Table | None = None
        self.run: str | None = None
        self.resumed: tuple[int, str] | None = None  # the local save resume loaded
        self.recorded = False  # every rank: the run record holds this job's incarnation (rank 0 said so)
        # rank 0 only: the run record as last read or written, this job's incarnation and its start
        self._record: RunRecord | None = None
        self._incarnation = new_run_id()
        self._start = -1
        self._recorded = False

    def close(self) -> None:
        self.server.close()

    def _me(self) -> Peer:
        return Peer(self.node, self.server.address, self.server.token)

    def _members(self, table: Table) -> list[int]:
        members = table.members(self.node)
        if members and members[0] == self.rank:
            foreign(self.folder, self.run)
        return members

    # ------------------------------------------------------------------------------------ save

    def _run_id(self, deadline: Deadline) -> str:
        """(rank 0, in a save's ``arrive``) The run's id: the recorded one (read by ``deadline``), else a new
        one (recorded by :meth:`_record_incarnation` once a save of it completed)."""
        if self._record is None:
            self._record = _read_record(self.fs, self.root, deadline)
        if self._record is None:
            self._record = RunRecord(new_run_id(), ())
        return self._record.run

    def _record_incarnation(self, deadline: Deadline) -> None:
        """(rank 0, in the ``done`` of a save that completed on every rank) Record this job's incarnation,
        with the step it resumed from, unless it is already. Only after a save of it completed: until
        then its shares do not count, and the run's earlier ones are not abandoned for a job that dies
        before it saved anything."""
        if self._recorded or self._record is None:
            return
        current = _read_record(self.fs, self.root, deadline)
        base = current if current is not None and current.run == self._record.run else self._record
        record = base.adding(self._incarnation, self._start)
        write_record(self.fs, self.root, record, _seconds(deadline))
        self._record, self._recorded = record, True

    def save(
        self, step: int, state: Mapping[str, Any], durable: int | None, clock: Clock | None = None
    ) -> LocalFailure | None:
        """(every rank) Save ``state`` as this rank's share of ``step`` and replicate it. Returns ``None``
        once every rank's share and replicas are in place, then applies retention (``durable``: the
        newest durable step, whose older local copies are dropped); returns the failure, the same on
        every rank, when the ranks agreed that some rank's part failed. A failure to agree (a rank dead,
        a deadline) raises. ``clock``: the public call's one deadline (default: one starting now), which
        bounds every wait: the agreements, the run record, this rank's share, its pushes, retention."""
        clock = self.deadlines.start() if clock is None else clock
        work = clock.work  # this rank's own I/O, a tenth before the end: the others hear of a failure
        op = Operation.begin("tier.save", self.tier.path_template, clock)

        def arrive(peers: dict[int, Peer]) -> TierStart:
            table = peer_table(peers)
            try:
                return TierStart(table, self._run_id(work), self._incarnation, new_save_id(), None)
            except (CheckpointError, OSError) as err:  # every rank's failure: reported, the job goes on
                return TierStart(table, None, None, None, f"{type(err).__name__}: {err}")

        def done(outcomes: dict[int, Attempt]) -> Attempts:
            attempts = collect(outcomes)
            if all(a.ok for a in attempts.attempts):
                try:
                    self._record_incarnation(work)
                except (CheckpointError, OSError) as err:  # the save does not count: every rank's failure
                    where = record_path(self.fs, self.root)
                    account = f"rank 0 (recording the run in {where}): {type(err).__name__}: {err}"
                    attempts = replace(attempts, attempts=[Attempt(False, False, account), *attempts.attempts[1:]])
            return attempts

        def body() -> tuple[Table, str, str] | LocalFailure:
            decided = op.agree(TIER_ARRIVE, self._me(), arrive)
            table = self.table = decided.table
            if decided.refused is not None or decided.run is None or decided.save is None:
                where = record_path(self.fs, self.root)
                return LocalFailure(0, f"rank 0 (the run record {where}): {decided.refused}", None)
            run = self.run = decided.run
            sid = decided.save
            error: Exception | None = None
            try:
                where = run_bounded(
                    "creating the local step folder",
                    self.folder,
                    work,
                    lambda: step_folder(self.folder, run, step, sid, create=True),
                )
                path = os.path.join(where, share_name(self.rank))
                meta = {
                    "step": step,
                    "rank": self.rank,
                    "world_size": self.world_size,
                    "run": run,
                    "save": sid,
                    "incarnation": decided.incarnation,
                }
                api.save(path, state, group=SOLO, timeout=_seconds(work), metadata=meta)
                for p in table.peers(self.rank, self.tier.replicas):
                    replica.push(table.addresses[p], table.tokens[p], path, meta, work)
            except Exception as err:  # shared with every rank below
                error = err
            mine = _outcome(error)
            if error is not None:
                account = f"rank {self.rank} (node {self.node}, folder {self.folder}): {mine.error}"
                mine = Attempt(False, False, account)
            outcomes = op.agree(TIER_DONE, mine, done).attempts
            failed = [(r, o) for r, o in enumerate(outcomes) if not o.ok]
            if failed:
                r, o = (self.rank, mine) if error is not None else failed[0]
                return LocalFailure(r, o.error, error)
            self.recorded = True
            return table, run, sid

        outcome = op.conclude(body)
        if isinstance(outcome, LocalFailure):
            return outcome
        table, run, save = outcome
        members = self._members(table)
        _housekeep(
            "applying the local tier's retention",
            self.folder,
            clock.end,
            lambda: retain(self.folder, run, self.rank, members, self.tier.keep, durable, step, save),
        )
        return None

    # ---------------------------------------------------------------------------------- resume

    def resume(self, state: MutableMapping[str, Any], durable: int | None, clock: Clock | None = None) -> int | None:
        """(every rank) Load the newest local save newer than ``durable`` that is complete across the
        nodes into ``state`` and return its step; ``None`` (state untouched unless a candidate failed to
        load, then the caller's durable resume overwrites it) when there is none. Call :meth:`begin`
        after it, whatever the outcome, once the resume decided. ``clock``: the public call's one deadline
        (default: one starting now), which bounds every wait: the agreements, the run record, the checks of
        this node's copies, every fetch from a peer and every load (no step gets a budget of its own)."""
        clock = self.deadlines.start() if clock is None else clock
        op = Operation.begin("tier.resume", self.tier.path_template, clock)
        return op.conclude(lambda: self._resume(op, state, durable))

    def _resume(self, op: Operation, state: MutableMapping[str, Any], durable: int | None) -> int | None:
        work = op.clock.work

        def arrive(peers: dict[int, Peer]) -> TierTable:
            try:
                self._record = _read_record(self.fs, self.root, work)
            except CheckpointError as err:
                logger.warning(
                    "shardsafe: local tier: the run record is not usable (%s); no local copy is used. %s",
                    err,
                    "Check the durable store"
                    if isinstance(err, CheckpointTimeoutError)
                    else "Move it away: the next local save records a new run",
                )
                self._record = None
            run = None if self._record is None else self._record.run
            return TierTable(peer_table(peers), run)

        decided = op.agree(TIER_RESUME_ARRIVE, self._me(), arrive)
        table = self.table = decided.table
        run = self.run = decided.run
        self.resumed = None
        members = self._members(table)
        mine = Copies([] if run is None else self._report(run, members, work))

        def decide(copies: dict[int, Copies]) -> TierPlan:
            reports = [copies[r].copies for r in range(len(copies))]
            return TierPlan(plan(reports, table.nodes, durable, self._record))

        candidates = op.agree(TIER_SCAN, mine, decide).candidates
        if run is None:  # no usable run record: no copy reported, none planned
            return None
        deadlines = self.deadlines
        for n, (step, save, incarnation, sources) in enumerate(candidates):
            holder, name = sources[self.rank]
            local = table.nodes[holder] == self.node
            where = os.path.join(self.folder, run_name(run), step_name(step, save))
            path = os.path.join(where, name if local else share_name(self.rank))
            meta = {
                "step": step,
                "rank": self.rank,
                "world_size": self.world_size,
                "run": run,
                "save": save,
                "incarnation": incarnation,
            }

            def fetch(holder: int = holder, name: str = name, meta: dict[str, Any] = meta, local: bool = local) -> None:
                if local:
                    return
                try:
                    where = run_bounded(
                        "creating the local step folder",
                        self.folder,
                        work,
                        lambda: step_folder(self.folder, meta["run"], meta["step"], meta["save"], create=True),
                    )
                    replica.pull(table.addresses[holder], table.tokens[holder], name, where, meta, work)
                except (CheckpointError, OSError) as err:  # this step cannot be had: an older one is tried
                    raise CorruptCheckpointError(
                        f"rank {self.rank}: its node holds no copy of its share of local step {meta['step']} and "
                        f"fetching {name} from rank {holder} failed: {err}"
                    ) from err

            def load(path: str = path) -> None:
                api.load(path, state, group=SOLO, timeout=_seconds(work), rest="none")

            why = _attempt(op, TIER_FETCH.nth(n), "fetch", fetch, path, deadlines)
            if why is None:
                why = _attempt(op, TIER_LOAD.nth(n), "load", load, path, deadlines)
            if why is None:
                if op.rank == 0:
                    moved = sorted({r for r, (h, _) in enumerate(sources) if table.nodes[h] != table.nodes[r]})
                    logger.info(
                        "shardsafe: resumed from the local tier, step %d (save %s)%s",
                        step,
                        save,
                        f" (the shares of ranks {moved} from other nodes)" if moved else "",
                    )
                self.resumed = (int(step), save)
                return int(step)
            if op.rank == 0:
                logger.warning("shardsafe: local step %d could not be resumed: %s; trying an older one", step, why)
        return None

    def begin(self, step: int | None, clock: Clock | None = None) -> None:
        """(every rank, once the resume decided ``step``: local, durable, or ``None`` for none) Rank 0
        records this job as a new incarnation of the run that resumed from ``step`` (a failure is logged
        and the first local save records it); then each rank deletes what it handles of the local steps
        newer than ``step`` (failures logged, never raised: the state is loaded already). ``clock``: the
        resume call's one deadline (default: one starting now); the ranks arrive within its arrival budget
        from now, and everything ends by its end."""
        clock = self.deadlines.start() if clock is None else later(clock)
        op = Operation.begin("tier.begin", self.tier.path_template, clock)

        def record(_nothing: dict[int, Empty]) -> Recorded:
            self._incarnation, self._start, self._recorded = new_run_id(), -1 if step is None else step, False
            if self._record is not None:
                try:
                    self._record = self._record.adding(self._incarnation, self._start)
                    write_record(self.fs, self.root, self._record, _seconds(clock.end))
                    self._recorded = True
                except (CheckpointError, OSError) as err:
                    logger.warning("shardsafe: local tier: %s; the first local save records it", err)
            return Recorded(self._recorded)

        self.recorded = op.conclude(lambda: op.agree(TIER_RECORD, Empty(), record)).recorded
        resumed = self.resumed if self.resumed is not None and self.resumed[0] == step else None
        if self.run is not None and self.table is not None:
            members = self.table.members(self.node)
            run, saved = self.run, None if resumed is None else resumed[1]
            _housekeep(
                "deleting the local steps newer than the one resumed",
                self.folder,
                clock.end,
                lambda: forget(self.folder, run, self.rank, members, step, saved),
            )

    def _report(self, run: str, members: list[int], deadline: Deadline) -> list[list[Any]]:
        """(each rank, at resume) :func:`report` of this node's copies, by ``deadline``: a copy whose check
        did not end by then is not usable (logged); a listing that hangs reports none (logged)."""
        try:
            return run_bounded(
                "checking the local tier's copies",
                self.folder,
                deadline,
                lambda: report(self.folder, run, self.rank, members, self.world_size, deadline),
            )
        except CheckpointTimeoutError as err:
            logger.warning("shardsafe: local tier: no local copy of this node is used: %s", err)
            return []


def _seconds(deadline: Deadline) -> float:
    """What is left of ``deadline``, as the ``timeout=`` of a call made within it (a call takes a positive
    number: past the deadline, its first wait raises at once)."""
    return max(deadline.remaining(), 0.001)


def later(clock: Clock) -> Clock:
    """The clock of a later operation of the call whose clock is ``clock``: its ranks arrive within the
    call's arrival budget from now, never past the call's end, which stays its end."""
    return replace(clock, arrive=clock.end.within(clock.budget.arrive, "arrive"))


def within_work(clock: Clock) -> Deadlines:
    """The budget of a step of the call whose clock is ``clock`` that runs a protocol of its own (the durable
    resume after the local tier's): what is left until the call's work deadline, so that the call's later
    agreements (``tier.begin``) still have the time to its end."""
    left = max(clock.work.remaining(), 0.001)
    return Deadlines(arrive=min(clock.budget.arrive, left), io=left)


def _read_record(fs: Storage, root: str, deadline: Deadline) -> RunRecord | None:
    """:func:`~shardsafe.manager.lineage.read_record`, by ``deadline`` (a hung store raises
    :class:`CheckpointTimeoutError`)."""
    return run_bounded("reading the local tier's run record", root, deadline, lambda: read_record(fs, root))


def _housekeep(what: str, folder: str, deadline: Deadline, fn: Callable[[], None]) -> None:
    """Run ``fn`` (deletes whose failures it logs itself) by ``deadline``; past it, an ERROR naming the
    folder (the state is saved or loaded already; a disk that hangs leaves the rest for the next call)."""
    try:
        run_bounded(what, folder, deadline, fn)
    except CheckpointTimeoutError as err:
        logger.error("shardsafe: local tier: the disk of %s is hung or far too slow: %s", folder, err)


def report(
    folder: str, run: str, rank: int, members: list[int], world_size: int, deadline: Deadline | None = None
) -> list[list[Any]]:
    """(each rank, at resume) The copies of run ``run`` in the node folder ``folder`` that ``rank`` handles
    (``members``: the node's ranks now) and that verify, as ``[step, save, incarnation, rank, name]``: each
    read whole (by ``deadline``: else it is not usable), its metadata checked against its place."""
    out: list[list[Any]] = []
    for step, save in saves_in(folder, run):
        where = os.path.join(folder, run_name(run), step_name(step, save))
        try:
            names = sorted(os.listdir(where))
        except OSError:
            continue
        for n in names:
            m = SHARE_RE.match(n) or REPLICA_RE.match(n)
            if m is None or handler(members, int(m.group(1))) != rank:
                continue
            want = {"step": step, "rank": int(m.group(1)), "world_size": world_size, "run": run, "save": save}
            incarnation = _usable(os.path.join(where, n), want, deadline)
            if incarnation is not None:
                out.append([step, save, incarnation, want["rank"], n])
    return out


def _usable(path: str, want: dict[str, Any], deadline: Deadline | None = None) -> str | None:
    """The incarnation of the local copy at ``path`` when it is committed, every byte matches its
    checksums, and its metadata is ``want`` (its place: step, rank, number of ranks, run and save) plus an
    incarnation; else ``None``, with a warning (a copy of another run is never used nor deleted)."""
    if not real_dir(path):
        warn_once(path, "is a symbolic link or not a folder: never read nor deleted through; left as it is")
        return None
    try:
        api.verify(path, timeout=None if deadline is None else _seconds(deadline))
        meta = api.inspect(path).metadata
    except (CheckpointError, OSError, EOFError) as err:
        logger.warning("shardsafe: local-tier copy %s is not usable: %s", path, err)
        return None
    incarnation = meta.get("incarnation") if isinstance(meta, dict) else None
    if isinstance(meta, dict) and meta.get("run") != want["run"]:
        warn_once(path, f"belongs to another run (its metadata: {meta!r:.200}): never used nor deleted")
        return None
    if not isinstance(incarnation, str) or meta != {**want, "incarnation": incarnation}:
        logger.warning("shardsafe: local-tier copy %s is not usable: its metadata is %r, not %r", path, meta, want)
        return None
    return incarnation


def plan(
    reports: list[list[list[Any]]], nodes: list[str], durable: int | None, record: RunRecord | None
) -> list[list[Any]]:
    """(rank 0) The local saves to try, newest first, as ``[step, save, incarnation, sources]``: newer than
    ``durable``, of an incarnation ``record`` counts at that step, every rank's share verified somewhere;
    ``sources[r]`` is ``[holder rank, entry name]``, a copy on rank r's own node when there is one."""
    world = len(reports)
    saves: dict[tuple[int, str], dict[str, Any]] = {}
    for holder, report in enumerate(reports):
        for step, save, incarnation, rank, name in report:
            entry = saves.setdefault((step, save), {"incarnations": set(), "copies": {}})
            entry["incarnations"].add(incarnation)
            if 0 <= rank < world:
                entry["copies"].setdefault(rank, []).append((holder, name))
    out: list[list[Any]] = []
    for (step, save), entry in sorted(saves.items(), reverse=True):
        if durable is not None and step <= durable:
            continue
        if len(entry["incarnations"]) != 1 or len(entry["copies"]) != world:
            continue
        incarnation = next(iter(entry["incarnations"]))
        if record is None or not record.counts(incarnation, step):
            logger.info("shardsafe: local step %d (save %s) belongs to an abandoned incarnation; not used", step, save)
            continue
        sources = []
        for r in range(world):
            copies = sorted(entry["copies"][r], key=lambda c: (c[0] != r or c[1] != share_name(r), c[0]))
            near = [c for c in copies if nodes[c[0]] == nodes[r]]
            sources.append(list((near or copies)[0]))
        out.append([step, save, incarnation, sources])
    return out
