"""The end of a save: every rank's write report, one decision, one publish, one acknowledgement.

This is the save's second agreement (``written``), with one key more than an ordinary one: the
decision. The outcome of a save is settled by the first ``compare_set`` on ``<save>/decision``:
``"commit"`` (rank 0, once every report is in and the manifest is durable in the pending directory) or an abort
(any rank that failed, gave up at its deadline, or found a rank dead). Nobody acts on an outcome
before it is decided and nobody undoes it after: rank 0 publishes only after it won "commit", and
the pending directory is discarded only where an abort won.

- (rank 0) :meth:`Committer.run`: wait for every report (watching the others' heartbeats), check them,
  build the manifest, validate its bytes with the loader's own parser, write it durably into the pending directory,
  propose "commit"; if it won, publish (under the end deadline; a publish that has not reached its
  commit point at the deadline is called off), post the outcome, remove the replaced checkpoint's
  unreferenced files, and wait for every live rank's acknowledgement.
- (other ranks) the same :meth:`Committer.run`: send the report, wait for the outcome (watching rank
  0's heartbeat). A rank that gives up, or finds rank 0 dead, proposes an abort; if "commit" had won
  already it asks the storage instead: a manifest carrying the save id means committed.

A rank whose own part failed sends its failure instead of a report, and proposes the abort at once, so
the others raise within a second. No interleaving of timeouts, failures and a slow publish leaves a
committed manifest without its data, and every rank sees one outcome.
"""

from __future__ import annotations

import errno
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from shardsafe import knobs
from shardsafe.catalog.delete import (
    delete_files,
    discard_save,
    manifest_files,
    release_references,
    remove_pending,
    stale_files,
    stale_side_files,
)
from shardsafe.catalog.names import commit_of, in_flight_marker
from shardsafe.catalog.orphans import abandoned_pending, orphaned_files
from shardsafe.catalog.refs import check_ref_files
from shardsafe.coord import Deadline, Operation, fault_point
from shardsafe.coord.agreement import Round
from shardsafe.coord.failures import Failure, wrap
from shardsafe.coord.messages import Committed, Envelope, Outcome, Timeout, WriteReport
from shardsafe.engine import incremental, replicas, sidefiles, unremoved
from shardsafe.engine.plan import Rules
from shardsafe.errors import CheckpointError, CorruptCheckpointError, RankDeadError, UnsafeValueError
from shardsafe.format.manifest import (
    Chunk,
    FileEntry,
    Manifest,
    TensorEntry,
    parse_manifest,
)
from shardsafe.progress.tracker import Tracker
from shardsafe.state import per_rank
from shardsafe.state.flatten import FlatState
from shardsafe.storage import MANIFEST_NAME, Commit, Storage, is_remote
from shardsafe.storage.base import PublishRefusedError
from shardsafe.workers import Lane, run_bounded

logger = logging.getLogger(__name__)

COMMIT = "commit"


@dataclass(frozen=True)
class CommitInputs:
    """What the end of a save needs, on every rank (rank 0 builds and publishes the manifest from it)."""

    path: str
    storage: Storage
    save_id: str
    pending: str
    overwrite: bool
    block_bytes: int
    flat: FlatState
    metadata: Any
    base_manifest: Manifest | None
    base_name: str
    started: float
    blocking_seconds: float
    side_written: tuple[str, ...] = ()
    """(rank 0) The side files this save wrote into its pending directory: an abort removes them by name."""
    rules: Rules = field(default_factory=Rules)
    """The tensors described by a sharding rule (format v3): no rank reports their chunks."""


@dataclass
class CommitResult:
    """What the end of a save found: ``committed`` (always true when :meth:`Committer.run` returns),
    the bytes of data files written by all ranks (rank 0), and the ranks that did not acknowledge."""

    committed: bool = False
    total_bytes: int = 0
    unacknowledged: list[int] = field(default_factory=list)


class _LeaderLost(Exception):
    """(internal) Rank 0 stopped after "commit" won: only the storage can tell whether it published."""


def discard(
    storage: Storage,
    path: str,
    pending: str,
    save_id: str,
    world_size: int,
    deadline: Deadline,
    *,
    remember: bool = False,
    side: tuple[str, ...] = (),
) -> bool:
    """(every rank, once an abort is the outcome) Remove what this save wrote, within ``deadline`` (a
    hung disk must not hang the error path); returns whether that worked. A failure is logged and,
    with ``remember`` (rank 0), kept for the next save of this process beside ``path``
    (:mod:`shardsafe.engine.unremoved`). ``side``: the side files this save wrote (rank 0)."""
    storage.set_deadline(deadline)  # its object-store requests are bounded by the same deadline
    try:
        run_bounded(
            "removing the files of the failed save",
            pending,
            deadline,
            lambda: discard_save(storage, pending, path, save_id, world_size, side),
        )
    except FileNotFoundError as err:  # another rank removed it first: the removal is shared and idempotent
        logger.debug("shardsafe: pending directory %s of a failed save was already removed: %s", pending, err)
    except (OSError, ValueError, CheckpointError) as err:
        logger.error(
            "shardsafe: could not remove the pending directory %s of a failed save: %s. It is never read; the next "
            "save that commits beside it removes it (SHARDSAFE_LEFTOVER_AGE_SECONDS).",
            pending,
            err,
        )
        if remember:
            unremoved.remember(unremoved.Unremoved(path, pending, save_id, world_size))
        return False
    return True


def refused(err: BaseException) -> bool:
    """Whether the storage refused the change (read-only, or not permitted): an ``OSError`` with errno
    ``EROFS``, ``EACCES`` or ``EPERM`` in ``err`` or its causes."""
    seen: set[int] = set()
    cur: BaseException | None = err
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def committed_on_storage(storage: Storage, path: str, save_id: str) -> bool:
    """Whether the manifest at ``path`` validates and carries ``save_id``."""
    where = storage.join(path, MANIFEST_NAME)
    try:
        return parse_manifest(storage.read_bytes(where), where).save_id == save_id
    except (OSError, CorruptCheckpointError):
        return False


class Committer:
    """(every rank) The end of one save; see the module docstring. ``set_phase`` names the phase this
    rank is in (errors, progress, stall reports)."""

    def __init__(self, op: Operation, inputs: CommitInputs, tracker: Tracker, set_phase: Callable[[str], None]) -> None:
        self.op = op
        self.inputs = inputs
        self.tracker = tracker
        self.set_phase = set_phase
        self.round: Round | None = None if op.single else op.round("written")
        self.decision = op.key("decision")
        self._leader_lost = False

    # ------------------------------------------------------------------------------ decision

    def _abort(self, outcome: Outcome, deadline: Deadline) -> Outcome | None:
        """(any rank) Propose ``outcome`` (a failure or a timeout) as the save's decision; the settled
        abort (maybe another rank's), or ``None`` when "commit" won first."""
        op, r = self.op, self.round
        if r is None:
            return outcome
        assert op.client is not None
        bound = deadline.or_grace()
        settled = op.client.compare_set(self.decision, outcome.to_text(), bound, op.tally)
        if settled == COMMIT:
            return None
        return r.propose(outcome if settled == outcome.to_text() else Outcome.from_text(settled), bound)

    def _raise(self, outcome: Outcome, own: BaseException | None) -> None:
        """(every rank) Discard the pending directory (an abort won) and raise what ``outcome`` says."""
        i, op = self.inputs, self.op
        if i.pending:
            discard(
                i.storage,
                i.path,
                i.pending,
                i.save_id,
                op.world_size,
                op.clock.arrive.or_grace(),
                remember=op.rank == 0,
                side=i.side_written,
            )
        self.op.acknowledge()
        self.op.settle(outcome, own)

    # ------------------------------------------------------------------------------ the round

    def run(self, report: WriteReport | None, error: BaseException | None, phase: str = "write") -> CommitResult:
        """(every rank, its data durable or its part failed in ``phase``) See the module docstring.
        Returns once the checkpoint is committed; raises the save's failure (the same on every rank)
        otherwise."""
        op = self.op
        deadline = op.clock.end
        failure = op.failure_of(error, phase) if error is not None else None
        if op.single:
            if error is not None:
                self._raise(Outcome(failure=failure), error)
            assert report is not None
            return self._lead({0: report})
        r = self.round
        assert r is not None
        op.status("written")
        r.send(Envelope(op.rank, None if report is None else report.to_json(), failure), deadline.or_grace())
        if failure is not None:
            settled = self._abort(Outcome(failure=failure), deadline)
            if settled is None:  # "commit" won without this rank's report: impossible; the storage tells
                raise CheckpointError(f"save of {self.inputs.path!r}: this rank failed after the commit decision")
            self._raise(settled, error)
        if op.rank == 0:
            return self._collect(r, deadline)
        return self._follow(r, deadline)

    def _collect(self, r: Round, deadline: Deadline) -> CommitResult:
        """(rank 0) Wait for every report, then lead."""
        op = self.op

        def dead(ranks: list[int], silent: float) -> None:
            self._abort(Outcome(failure=op.dead_failure(ranks[0], "written", silent)), deadline)

        got = r.wait(r.ready, deadline, r.watch_others(dead), r.stalled("every rank to reach 'written'", deadline))
        if got is None:
            settled = self._abort(_timeout(r, deadline), deadline)
            assert settled is not None
            self._raise(settled, None)
        envelopes = r.messages(deadline.or_grace())
        failed = [e.failure for _, e in sorted(envelopes.items()) if e.failure is not None]
        if failed or len(envelopes) < op.world_size:
            assert op.client is not None
            if failed:
                settled = self._abort(Outcome(failure=failed[0]), deadline)
            else:  # woken by an outcome proposed early (a dead rank): read it
                settled = Outcome.from_text(op.client.get(self.decision, deadline.or_grace(), op.tally))
            assert settled is not None
            self._raise(settled, None)
        reports = {rank: WriteReport.from_json(e.body) for rank, e in envelopes.items()}
        return self._lead(reports)

    def _lead(self, reports: dict[int, WriteReport]) -> CommitResult:
        """(rank 0, every report in) Decide, publish, acknowledge."""
        op, i = self.op, self.inputs
        deadline = op.clock.end
        self.set_phase("commit")
        self.tracker.final({r: rep.counts for r, rep in reports.items()})
        try:
            fault_point("save.commit", op.global_rank)
            manifest = build_manifest(i, op.world_size, reports)
            raw = manifest.to_bytes()
            where = i.storage.join(i.path, MANIFEST_NAME)
            try:
                parse_manifest(raw, where)  # what a loader will read: never publish what it would refuse
            except CorruptCheckpointError as err:
                raise UnsafeValueError(
                    f"save of {i.path!r}: the state holds something the format cannot store: {err}"
                ) from None
            i.storage.set_deadline(deadline)
            commit = commit_of(i.pending, i.path, i.save_id, raw, [*manifest.files, *manifest.side_files])
            i.storage.stage_manifest(commit)
            if manifest.refs:
                # An incremental save: its intent (the staged manifest, which a delete of a base reads
                # after writing its tombstone) is on storage first; then its bases are checked: still
                # committed, not being deleted, every referred file there. One of the two sees the other.
                check_ref_files(i.storage, i.path, manifest, committed=i.base_name)
        except BaseException as err:
            decided = isinstance(err, CheckpointError)
            failure = op.failure_of(err, "commit", decided=decided)
            if decided:
                op.own_decided = err  # type: ignore[assignment]
            settled = self._abort(Outcome(failure=failure), deadline)
            assert settled is not None
            self._raise(settled, err)
            raise  # not reached: _raise raises
        self.set_phase("decide")
        if not op.single:
            assert op.client is not None
            settled_text = op.client.compare_set(self.decision, COMMIT, deadline.or_grace(), op.tally)
            if settled_text != COMMIT:
                self._raise(Outcome.from_text(settled_text), None)
        self.set_phase("publish")
        old = self._publish(commit, raw)
        if self.round is not None:
            self.round.propose(Outcome(body=Committed(i.save_id).to_json()), deadline.or_grace())
        self._remove_stale(old, raw, where)
        self._confirm()
        self.set_phase("acknowledge")
        late = op.acknowledge()
        total = sum(int(f[0]) for rep in reports.values() for f in rep.files.values())
        took = time.monotonic() - i.started
        logger.info(
            "shardsafe: saved %s (%.1f MiB, %d ranks, %s) in %.2fs (%.0f MiB/s; blocking %.2fs)",
            i.path,
            total / 2**20,
            op.world_size,
            i.flat.strategy,
            took,
            total / 2**20 / max(took, 1e-9),
            i.blocking_seconds,
        )
        return CommitResult(True, total, late)

    def _publish(self, commit: Commit, raw: bytes) -> bytes | None:
        """(rank 0, "commit" won) Make the manifest visible within the end deadline; on failure, post
        the failure as the outcome, discard the pending directory when the publish surely did not happen, and raise."""
        op, i = self.op, self.inputs
        gate = _Gate()

        def work() -> bytes | None:
            fault_point("save.publish", op.global_rank)
            if gate.cancelled:  # called off while this thread was held up: touch nothing
                raise TimeoutError("publish called off: the save's deadline passed")
            return i.storage.publish(commit, overwrite=i.overwrite, at_commit=gate)

        lane = Lane("publish")
        try:
            return lane.call("publishing the manifest", i.path, work, op.clock.end)
        except BaseException as err:
            hung = lane.wedged
            never = gate.cancel() if hung else not gate.passed
            if not never and not hung and committed_on_storage(i.storage, i.path, i.save_id):
                logger.warning("shardsafe: publishing %s raised (%s), but it is committed", i.path, err)
                return None
            if not hung and (not is_remote(i.path) or isinstance(err, PublishRefusedError)):
                never = True  # a local rename that raised did not happen; nor a PUT the store refused
            if never:
                message = (
                    f"save of {i.path!r}: rank 0's publish failed ({type(err).__name__}: {err}); nothing was "
                    "committed, and the checkpoint that was there, if any, is unchanged and loadable. "
                    + (
                        "The storage refused the change (read-only, say remounted read-only after an error, or not "
                        f"permitted): make {i.path!r} and its parent folder writable again, then save again."
                        if refused(err)
                        else "Fix the cause and save again."
                    )
                )
            else:
                message = (
                    f"save of {i.path!r}: rank 0's publish did not complete ({type(err).__name__}: {err}); it may "
                    f"still complete if the storage recovers: the checkpoint is committed iff {MANIFEST_NAME} there "
                    f"carries save id {i.save_id}. Check the storage, then save again."
                )
            failure = Failure(op.global_rank, "publish", "CheckpointError", message, decided=True)
            if self.round is not None:
                try:
                    self.round.propose(Outcome(failure=failure), op.clock.end.or_grace())
                except RankDeadError as lost:
                    logger.error("shardsafe: could not tell the ranks that publishing %s failed: %s", i.path, lost)
            if never and not discard(
                i.storage,
                i.path,
                i.pending,
                i.save_id,
                op.world_size,
                op.clock.arrive.or_grace(),
                remember=True,
                side=i.side_written,
            ):
                message += (
                    f" What this save wrote could not be removed either ({i.pending}); it is never read, and the next "
                    "save that commits beside it removes it."
                )
            op.acknowledge()
            raise CheckpointError(message) from err
        finally:
            lane.close()

    def _remove_stale(self, old: bytes | None, new: bytes, where: str) -> None:
        """(rank 0, committed) Remove the data files of the replaced checkpoint that the new manifest
        does not list (taken from the old manifest, validated), then what only the old manifest referred
        to in sibling checkpoints; then :meth:`_sweep`. A failure leaves unreferenced files (logged)."""
        i = self.inputs
        began = time.monotonic()
        stale = stale_files(old, new, where)
        # URL storage: the save's in-flight marker goes too, in the same request (its data files are listed)
        marker = [in_flight_marker(i.save_id)] if i.pending == i.path else []
        stale_side = stale_side_files(old, new, where)

        def remove() -> None:
            delete_files(i.storage, i.path, [*stale, *marker])
            if stale_side:
                delete_files(i.storage, i.path, stale_side, side=stale_side)
            release_references(i.storage, i.path, old, where)

        grace = self.op.clock.end.or_grace()
        i.storage.set_deadline(grace)  # its requests to an object store are bounded by the same
        try:
            run_bounded("removing the old data files", i.path, grace, remove)
        except (OSError, ValueError, CheckpointError) as err:
            logger.warning("shardsafe: committed %s but could not remove old data files %s: %s", i.path, stale, err)
        try:
            run_bounded("removing what failed saves left", i.path, grace, lambda: self._sweep(new, where))
        except (OSError, ValueError, CheckpointError) as err:
            logger.warning("shardsafe: committed %s but could not remove what failed saves left there: %s", i.path, err)
        logger.debug(
            "shardsafe: save %s rank 0: removed %d replaced file(s) in %.3fs",
            i.path,
            len(stale),
            time.monotonic() - began,
        )

    def _sweep(self, new: bytes, where: str) -> None:
        """(rank 0, committed) Remove what failed saves of this process beside the path could not
        remove themselves (:mod:`shardsafe.engine.unremoved`), then the pending directories that saves
        of the path, or of a sibling path, which never committed left beside it
        (:func:`~shardsafe.catalog.orphans.abandoned_pending`), then the orphans of such saves in it
        (:func:`~shardsafe.catalog.orphans.orphaned_files`), these two once older than
        ``SHARDSAFE_LEFTOVER_AGE_SECONDS``."""
        i = self.inputs
        for left in unremoved.beside(i.path):
            try:
                discard_save(i.storage, left.pending, left.path, left.save_id, left.world_size)
            except (OSError, ValueError, CheckpointError) as err:
                logger.warning(
                    "shardsafe: still cannot remove what failed save %s left in %s: %s", left.save_id, left.pending, err
                )
                continue
            unremoved.forget(left)
            logger.info("shardsafe: removed what failed save %s of %s left (%s)", left.save_id, left.path, left.pending)
        age = knobs.leftover_age_seconds()
        # first: a save whose pending directory is gone is no longer in flight, and its files in the
        # checkpoint are orphans
        for pending in abandoned_pending(i.storage, i.path, min_age=age, siblings=True):
            try:
                if remove_pending(i.storage, pending):
                    logger.info(
                        "shardsafe: removed %s, left by a save that never committed (beside %s)", pending, i.path
                    )
            except (OSError, ValueError) as err:  # one that cannot go does not keep the rest
                logger.warning(
                    "shardsafe: could not remove %s, left by a save that never committed (beside %s): %s",
                    pending,
                    i.path,
                    err,
                )
        _, listed = manifest_files(new, where)
        orphans = orphaned_files(i.storage, i.path, listed, min_age=age)
        if orphans:
            removed = delete_files(i.storage, i.path, orphans)
            logger.info(
                "shardsafe: removed %s from %s: data files no manifest lists, unchanged for over %.0fs (a save there "
                "that never committed; SHARDSAFE_LEFTOVER_AGE_SECONDS)",
                removed,
                i.path,
                age,
            )

    def _follow(self, r: Round, deadline: Deadline) -> CommitResult:
        """(ranks other than 0, report sent) Learn the outcome; see the module docstring."""
        op = self.op
        self.set_phase("decision")
        wake_flag = threading.Event()

        def dead(_ranks: list[int], silent: float) -> None:
            if self._abort(Outcome(failure=op.dead_failure(0, "written", silent)), deadline) is None:
                self._leader_lost = True
                wake_flag.set()

        watch = r.watch_leader(dead)

        def interrupt() -> None:
            if self._leader_lost:
                raise _LeaderLost()

        assert op.client is not None and op.dog is not None
        op.dog.watch(watch)
        try:
            raw = op.client.wait_value(r.outcome, deadline, tally=op.tally, interrupt=interrupt, wake=watch.wake)
            if raw is None:
                settled = self._abort(_timeout(r, deadline), deadline)
                if settled is not None:
                    self._raise(settled, None)
                # "commit" won: rank 0 is publishing; give it until the grace after the end
                raw = op.client.wait_value(r.outcome, deadline.or_grace(), tally=op.tally, interrupt=interrupt)
        except _LeaderLost:
            return self._ask_storage("rank 0 stopped responding after deciding to commit")
        except RankDeadError as err:
            if err.store_lost:
                return self._ask_storage(str(err), err)
            raise
        finally:
            op.dog.unwatch(watch)
        if raw is None:
            return self._ask_storage(
                f"rank 0 decided to commit but did not report its publish within the end deadline "
                f"({deadline.seconds:.0f}s)"
            )
        outcome = Outcome.from_text(raw)
        if outcome.body is None:
            self._raise(outcome, None)
        self._confirm()
        self.set_phase("acknowledge")
        op.acknowledge()
        return CommitResult(True)

    def _confirm(self) -> None:
        """(every rank, the outcome "committed" read) The last fault point; a failure here is this rank's
        own, after the commit: raised (wrapped), the checkpoint stands."""
        try:
            fault_point("save.confirm", self.op.global_rank)
        except Exception as err:
            raise wrap(err, op="save", target=self.inputs.path, rank=self.op.global_rank, phase="confirm") from err

    def _ask_storage(self, why: str, cause: BaseException | None = None) -> CommitResult:
        """ "commit" won but rank 0 cannot confirm the publish: the storage says whether it happened."""
        i = self.inputs
        if committed_on_storage(i.storage, i.path, i.save_id):
            logger.warning(
                "shardsafe: rank %d: %s, but %s is committed with save id %s; this save succeeded",
                self.op.rank,
                why,
                i.path,
                i.save_id,
            )
            return CommitResult(True)
        err = RankDeadError(
            f"save of {i.path!r}: {why}, and the checkpoint is not committed (it may still appear if rank 0's storage "
            "recovers: it is committed iff its manifest carries save id "
            f"{i.save_id}). Restart the job; it resumes from the last committed checkpoint.",
            store_lost=isinstance(cause, RankDeadError) and cause.store_lost,
        )
        raise err from cause


def _timeout(r: Round, deadline: Deadline) -> Outcome:
    """The timeout a rank proposes when its deadline passed in the ``written`` agreement."""
    op = r.op
    sent = set(r.messages(deadline.or_grace()))
    arrived = sorted(sent | {0})
    missing = [x for x in range(op.world_size) if x not in sent] if op.rank == 0 else [0]
    return Outcome(timeout=Timeout(op.rank, r.phase, arrived, missing, deadline.budget, deadline.seconds))


class _Gate:
    """Called by the publishing thread right before the commit point; a publish called off at the
    deadline raises there instead of committing."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.cancelled = False
        self.passed = False

    def __call__(self) -> None:
        with self._lock:
            if self.cancelled:
                raise TimeoutError("publish called off: the save's deadline passed before the commit point")
            self.passed = True

    def cancel(self) -> bool:
        """Call the publish off; whether that worked (the commit point was not reached)."""
        with self._lock:
            self.cancelled = True
            return not self.passed


def build_manifest(i: CommitInputs, world_size: int, reports: dict[int, WriteReport]) -> Manifest:
    """(rank 0) The manifest of the save, from every rank's report. Raises :class:`CheckpointError` when
    the ranks' structures or block sizes differ."""
    fingerprints = {rep.fingerprint for rep in reports.values()}
    if len(fingerprints) > 1:
        mismatch = sorted(r for r, rep in reports.items() if rep.fingerprint != reports[0].fingerprint)
        raise CheckpointError(
            f"save of {i.path!r}: ranks {mismatch} passed a state with other keys, shapes or dtypes than rank 0. "
            "Every rank must save the same structure (the same model and optimizer)."
        )
    replicas.check(i.path, i.flat, {r: rep.replicas for r, rep in reports.items()})  # refused before the commit
    blocks = sorted({rep.block_bytes for rep in reports.values()})
    if blocks != [i.block_bytes]:
        raise CheckpointError(f"save of {i.path!r}: ranks wrote with checksum block sizes {blocks}")
    chunks: dict[str, list[Chunk]] = {}
    files: dict[str, FileEntry] = {}
    for rank in sorted(reports):
        rep = reports[rank]
        for fname, (size, header_bytes, header_sum, *index) in rep.files.items():
            files[fname] = FileEntry(size, header_bytes, header_sum, index[0] if index else None)
        for name, c in rep.chunks:
            chunks.setdefault(name, []).append(
                Chunk(
                    tuple(c["offsets"]),
                    tuple(c["sizes"]),
                    c["file"],
                    c["key"],
                    c["begin"],
                    c["end"],
                    tuple(c["checksums"]),
                    c["digest"],
                    c["ref"],
                )
            )
    flat = i.flat
    legacy = [{"rank": r, "per_rank": reports[r].per_rank} for r in sorted(reports)]
    own = per_rank.merge_reports(flat, legacy, chunks)
    tensors = {}
    for item in flat.items:
        rule = i.rules.tensors.get(item.name)
        if rule is not None:  # its chunks follow from the rule; each writer checked its own against it
            tensors[item.name] = TensorEntry(item.local.dtype, item.shape, (), rule)
            continue
        mine = sorted(chunks.get(item.name, []), key=lambda c: c.offsets)
        if sum(math.prod(c.sizes) for c in mine) != math.prod(item.shape):
            raise CheckpointError(
                f"save of {i.path!r}: tensor {item.name!r} was not fully written by the ranks (planning differed "
                "between ranks); every rank must pass the same state structure"
            )
        tensors[item.name] = TensorEntry(item.local.dtype, item.shape, tuple(mine))
    tensors.update(own)
    from shardsafe.version import __version__

    side = sidefiles.merge({r: rep.side for r, rep in reports.items()}, i.path)
    return Manifest(
        save_id=i.save_id,
        created=time.time(),
        world_size=world_size,
        strategy=flat.strategy,
        library={"shardsafe": __version__, "torch": torch.__version__.split("+")[0]},
        block_bytes=i.block_bytes,
        metadata=i.metadata,
        objects=flat.objects,
        tensors=tensors,
        files=files,
        refs=incremental.ref_table(i.base_manifest, i.base_name, [c for cs in chunks.values() for c in cs])
        if i.base_manifest is not None
        else {},
        side_files=side,
        meshes=i.rules.meshes,
    )
