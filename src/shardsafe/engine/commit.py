"""The end of a save, declared, not hand-written: the commitment ``written``
(:data:`~shardsafe.engine.messages.SAVE_WRITTEN`) run by the protocol engine
(:meth:`Operation.commit <shardsafe.coord.operation.Operation.commit>`: decide, act, confirm), with what
only a save knows handed to it:

- decide (rank 0, every write report in): build the manifest, validate its bytes with the loader's own
  parser, write it durably into the pending directory, check the bases of an incremental save
  (:meth:`Committer._decide`); a refusal is the outcome for every rank;
- act (rank 0, once it won "go" on the decision key): publish, under the end deadline; a publish that
  has not reached its commit point at the deadline is called off (:meth:`Committer._publish`);
- abandon (every rank, once an abort won): discard the pending directory (:func:`discard`);
- probe (another rank that lost rank 0 or the store after "go"): a manifest carrying the save id means
  committed (:meth:`Committer._ask_storage`).

Then rank 0 removes the replaced checkpoint's unreferenced files and what failed saves left, and every
rank acknowledges; rank 0 returns once every live rank has. No interleaving of timeouts, failures and
a slow publish leaves a committed manifest without its data, and every rank sees one outcome.
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
    remove_pending,
)
from shardsafe.catalog.orphans import abandoned_pending, orphaned_files
from shardsafe.catalog.publish import CheckpointPublication
from shardsafe.catalog.refs import check_ref_files
from shardsafe.coord import Deadline, Operation, fault_point
from shardsafe.coord.failures import wrap
from shardsafe.engine import incremental, replicas, sidefiles, unremoved
from shardsafe.engine.messages import SAVE_WRITTEN, Committed, WriteReport
from shardsafe.engine.plan import Rules
from shardsafe.errors import (
    CheckpointError,
    CheckpointTimeoutError,
    CommitFailedError,
    CorruptCheckpointError,
    InconsistentRanksError,
    RankDeadError,
    UnsafeValueError,
)
from shardsafe.format.manifest import (
    Chunk,
    FileEntry,
    Manifest,
    TensorEntry,
)
from shardsafe.progress.tracker import Tracker
from shardsafe.state import per_rank
from shardsafe.state.flatten import FlatState
from shardsafe.storage import MANIFEST_NAME, Commit, Storage, is_remote
from shardsafe.storage.base import PublishRefusedError
from shardsafe.workers import Lane, run_bounded

logger = logging.getLogger(__name__)


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
    try:
        CheckpointPublication(storage, path, save_id, pending=pending).abandon(world_size, deadline, side=side)
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


@dataclass(frozen=True)
class _Decided:
    """(rank 0) What the save decided to publish: the commit, the manifest's bytes and where it goes,
    and the bytes of data files every rank wrote."""

    commit: Commit
    raw: bytes
    where: str
    total: int


class Committer:
    """(every rank) The end of one save: the commitment ``written``
    (:data:`~shardsafe.engine.messages.SAVE_WRITTEN`, run by
    :meth:`Operation.commit <shardsafe.coord.operation.Operation.commit>`); see the module docstring.
    ``set_phase`` names the phase this rank is in (errors, progress, stall reports)."""

    def __init__(self, op: Operation, inputs: CommitInputs, tracker: Tracker, set_phase: Callable[[str], None]) -> None:
        self.op = op
        self.inputs = inputs
        self.tracker = tracker
        self.set_phase = set_phase
        self._old: bytes | None = None  # rank 0: the manifest the publish replaced
        self._never = False  # rank 0: a failed publish surely did not happen
        self._probed = False  # another rank: the storage, not rank 0, confirmed the commit
        self.publication = CheckpointPublication(inputs.storage, inputs.path, inputs.save_id, pending=inputs.pending)

    def run(self, report: WriteReport | None, error: BaseException | None, phase: str = "write") -> CommitResult:
        """(every rank, its data durable or its part failed in ``phase``) See the module docstring.
        Returns once the checkpoint is committed; raises the save's failure (the same on every rank)
        otherwise."""
        op = self.op
        decided: list[_Decided] = []

        def decide(reports: dict[int, WriteReport]) -> _Decided:
            decided.append(self._decide(reports))
            return decided[0]

        op.commit(
            SAVE_WRITTEN,
            report,
            failure=error,
            failed_in=phase,
            decide=decide,
            act=self._publish,
            acted_failed=self._publish_failed,
            abandon=self._abandon,
            probe=self._ask_storage,
            on_phase=self.set_phase,
        )
        if self._probed:  # rank 0 is gone: nobody to acknowledge to
            return CommitResult(True)
        if decided:
            self._remove_stale(self._old, decided[0].raw, decided[0].where)
        self._confirm()
        self.set_phase("acknowledge")
        late = op.acknowledge()
        if not decided:
            return CommitResult(True)
        i = self.inputs
        total = decided[0].total
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

    def _abandon(self) -> None:
        """(every rank, an abort is the outcome) Discard the pending directory."""
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

    def _decide(self, reports: dict[int, WriteReport]) -> _Decided:
        """(rank 0, every report in) Build the manifest, check it with the loader's parser, stage it
        durably, check the bases of an incremental save. A :class:`CheckpointError` is the outcome for
        every rank."""
        op, i = self.op, self.inputs
        self.tracker.final({r: rep.counts for r, rep in reports.items()})
        fault_point("save.commit", op.global_rank)
        manifest = build_manifest(i, op.world_size, reports)
        raw = manifest.to_bytes()
        where = self.publication.where
        try:  # what a loader will read: never publish what it would refuse; then staged durably
            commit = self.publication.verify(raw, [*manifest.files, *manifest.side_files], op.clock.end)
        except CorruptCheckpointError as err:
            raise UnsafeValueError(
                f"save of {i.path!r}: the state holds something the format cannot store: {err}"
            ) from None
        if manifest.refs:
            # An incremental save: its intent (the staged manifest, which a delete of a base reads
            # after writing its tombstone) is on storage first; then its bases are checked: still
            # committed, not being deleted, every referred file there. One of the two sees the other.
            check_ref_files(i.storage.within(op.clock.end), i.path, manifest, committed=i.base_name)
        total = sum(int(f[0]) for rep in reports.values() for f in rep.files.values())
        return _Decided(commit, raw, where, total)

    def _publish(self, decided: _Decided) -> Committed:
        """(rank 0, "go" won) Make the manifest visible within the end deadline. On failure, raise the
        save's error (every rank raises it), noting whether the publish surely did not happen."""
        op, i = self.op, self.inputs
        gate = _Gate()

        def work() -> bytes | None:
            fault_point("save.publish", op.global_rank)
            if gate.cancelled:  # called off while this thread was held up: touch nothing
                raise TimeoutError("publish called off: the save's deadline passed")
            return self.publication.publish(
                decided.commit, overwrite=i.overwrite, at_commit=gate, deadline=op.clock.end
            )

        lane = Lane("publish")
        try:
            self._old = lane.call("publishing the manifest", i.path, work, op.clock.end)
            return Committed(i.save_id)
        except BaseException as err:
            hung = lane.wedged
            never = gate.cancel() if hung else not gate.passed
            if not never and not hung and self.publication.committed(op.clock.end.or_grace()):
                logger.warning("shardsafe: publishing %s raised (%s), but it is committed", i.path, err)
                return Committed(i.save_id)
            if not hung and (not is_remote(i.path) or isinstance(err, PublishRefusedError)):
                never = True  # a local rename that raised did not happen; nor a PUT the store refused
            self._never = never
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
            raise (CheckpointTimeoutError if isinstance(err, TimeoutError) else CommitFailedError)(message) from err
        finally:
            lane.close()

    def _publish_failed(self, err: BaseException) -> BaseException | None:
        """(rank 0, its failed publish told to every rank) Discard the pending directory when the publish
        surely did not happen; the error to raise instead of ``err`` when that failed too."""
        i, op = self.inputs, self.op
        if self._never and not discard(
            i.storage,
            i.path,
            i.pending,
            i.save_id,
            op.world_size,
            op.clock.arrive.or_grace(),
            remember=True,
            side=i.side_written,
        ):
            worse = (CheckpointTimeoutError if isinstance(err, TimeoutError) else CommitFailedError)(
                f"{err} What this save wrote could not be removed either ({i.pending}); it is never read, and the "
                "next save that commits beside it removes it."
            )
            worse.__cause__ = err.__cause__
            return worse
        return None

    def _remove_stale(self, old: bytes | None, new: bytes, where: str) -> None:
        """(rank 0, committed) Retire what the new manifest replaced (the publication's last step:
        :meth:`CheckpointPublication.retire <shardsafe.catalog.publish.CheckpointPublication.retire>`),
        then :meth:`_sweep`, both within the grace after the end. A failure leaves unreferenced files
        (logged)."""
        i = self.inputs
        began = time.monotonic()
        grace = self.op.clock.end.or_grace()
        stale: list[str] = []
        try:
            stale = self.publication.retire(old, new, grace)
        except (OSError, ValueError, CheckpointError) as err:
            logger.warning("shardsafe: committed %s but could not remove the replaced files: %s", i.path, err)
        storage = i.storage.within(grace)
        try:
            run_bounded("removing what failed saves left", i.path, grace, lambda: self._sweep(storage, new, where))
        except (OSError, ValueError, CheckpointError) as err:
            logger.warning("shardsafe: committed %s but could not remove what failed saves left there: %s", i.path, err)
        logger.debug(
            "shardsafe: save %s rank 0: removed %d replaced file(s) in %.3fs",
            i.path,
            len(stale),
            time.monotonic() - began,
        )

    def _sweep(self, storage: Storage, new: bytes, where: str) -> None:
        """(rank 0, committed) Remove what failed saves of this process beside the path could not
        remove themselves (:mod:`shardsafe.engine.unremoved`), then the pending directories that saves
        of the path, or of a sibling path, which never committed left beside it
        (:func:`~shardsafe.catalog.orphans.abandoned_pending`), then the orphans of such saves in it
        (:func:`~shardsafe.catalog.orphans.orphaned_files`), these two once older than
        ``SHARDSAFE_LEFTOVER_AGE_SECONDS``."""
        i = self.inputs
        for left in unremoved.beside(i.path):
            try:
                discard_save(storage, left.pending, left.path, left.save_id, left.world_size)
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
        for pending in abandoned_pending(storage, i.path, min_age=age, siblings=True):
            try:
                if remove_pending(storage, pending):
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
        orphans = orphaned_files(storage, i.path, listed, min_age=age)
        if orphans:
            removed = delete_files(storage, i.path, orphans)
            logger.info(
                "shardsafe: removed %s from %s: data files no manifest lists, unchanged for over %.0fs (a save there "
                "that never committed; SHARDSAFE_LEFTOVER_AGE_SECONDS)",
                removed,
                i.path,
                age,
            )

    def _confirm(self) -> None:
        """(every rank, the outcome "committed" read) The last fault point; a failure here is this rank's
        own, after the commit: raised (wrapped), the checkpoint stands."""
        try:
            fault_point("save.confirm", self.op.global_rank)
        except Exception as err:
            raise wrap(err, op="save", target=self.inputs.path, rank=self.op.global_rank, phase="confirm") from err

    def _ask_storage(self, why: str, cause: BaseException | None = None) -> Committed:
        """(a rank other than 0) "go" won but rank 0 cannot confirm the publish: the storage says whether
        it happened."""
        i = self.inputs
        if self.publication.committed(self.op.clock.end.or_grace()):
            logger.warning(
                "shardsafe: rank %d: %s, but %s is committed with save id %s; this save succeeded",
                self.op.rank,
                why,
                i.path,
                i.save_id,
            )
            self._probed = True
            return Committed(i.save_id)
        err = RankDeadError(
            f"save of {i.path!r}: {why}, and the checkpoint is not committed (it may still appear if rank 0's storage "
            "recovers: it is committed iff its manifest carries save id "
            f"{i.save_id}). Restart the job; it resumes from the last committed checkpoint.",
            store_lost=isinstance(cause, RankDeadError) and cause.store_lost,
        )
        raise err from cause


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
        raise InconsistentRanksError(
            f"save of {i.path!r}: ranks {mismatch} passed a state with other keys, shapes or dtypes than rank 0. "
            "Every rank must save the same structure (the same model and optimizer)."
        )
    replicas.check(i.path, i.flat, {r: rep.replicas for r, rep in reports.items()})  # refused before the commit
    blocks = sorted({rep.block_bytes for rep in reports.values()})
    if blocks != [i.block_bytes]:
        raise InconsistentRanksError(f"save of {i.path!r}: ranks wrote with checksum block sizes {blocks}")
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
            raise InconsistentRanksError(
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
