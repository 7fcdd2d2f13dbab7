"""The end of a save, after every rank has reported its data: one decision, one publish, one
acknowledgement (DESIGN.md, save protocol steps 5 and 6; docs/faults.md).

The outcome of a save is the value of its decision key, set by the first ``compare_set`` on it
(:meth:`~shardsafe.coord.Coordinator.decide`): ``"commit"``, or an abort record.

- (rank 0) :func:`lead`: check the reports, build the manifest, validate its bytes with the loader's
  own parser, write it durably into staging, then propose "commit". Only if "commit" won does it
  publish (on a worker thread, under the io deadline; at the deadline a publish that has not reached
  its commit point is called off), post the ``published`` record, remove the old checkpoint's
  unreferenced files, and wait for every live rank's acknowledgement.
- (other ranks) :func:`follow`: wait for the decision; a rank that gives up waiting, or sees rank 0
  die first, proposes "abort". Where "commit" won they wait for ``published`` (rank 0's publish
  deadline plus the arrival deadline); if rank 0 dies or the store goes away meanwhile, they ask the
  storage: a manifest carrying their save id means committed, and they return normally.

Staging is discarded only where "abort" won (every rank, :func:`discard`), or by rank 0 when it
knows that its own publish did not and will not happen. So no interleaving of timeouts, failures
and a slow publish leaves a committed manifest without its data, and every rank sees one outcome.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from shardsafe.coord import Coordinator, Deadlines, fault_point
from shardsafe.errors import (
    CheckpointError,
    CoordinationError,
    CorruptCheckpointError,
    RankDeadError,
    RankTimeoutError,
    RemoteRankError,
)
from shardsafe.format.manifest import parse_manifest
from shardsafe.state.flatten import FlatState
from shardsafe.storage import MANIFEST_NAME, Commit, is_remote
from shardsafe.storage.bounded import IOThread, run_bounded
from shardsafe.storage.delete import delete_files, discard_save, release_references, stale_files
from shardsafe.storage.refs import check_ref_files

if TYPE_CHECKING:
    from shardsafe.engine.save import SaveJob

logger = logging.getLogger(__name__)

COMMIT = "commit"


def abort_record(rank: int, phase: str, err: BaseException) -> str:
    """The value a failing or timing-out rank proposes on the decision key."""
    return json.dumps({"abort": True, "rank": rank, "phase": phase, "error": f"{type(err).__name__}: {err}"})


def finish_bound(deadlines: Deadlines) -> float:
    """Seconds the background half of a save (``SaveJob.finish``) can take at most on any rank: the
    writes and the report barrier, the decision, the publish (with the wait for its result), and the
    acknowledgement."""
    return 3 * deadlines.io + 2 * deadlines.arrive


def discard(job: SaveJob) -> None:
    """(every rank, once "abort" is the outcome) Remove what this save wrote, under the arrival
    deadline (a hung disk must not hang the error path); failures are logged."""
    assert job.coord is not None
    world = job.coord.world_size
    began = time.monotonic()
    try:
        run_bounded(
            "removing the files of the failed save",
            job.staging,
            time.monotonic() + job.deadlines.arrive,
            lambda: discard_save(job.storage, job.staging, job.path, job.save_id, world),
        )
    except (OSError, ValueError) as err:
        logger.error("shardsafe: could not remove staging %s of a failed save: %s", job.staging, err)
    logger.debug(
        "shardsafe: save %s rank %d: cleanup took %.3fs", job.path, job.coord.global_rank, time.monotonic() - began
    )


def committed_on_storage(job: SaveJob) -> bool:
    """Whether the manifest at the target validates and carries this save's id."""
    where = job.storage.join(job.path, MANIFEST_NAME)
    try:
        return parse_manifest(job.storage.read_bytes(where), where).save_id == job.save_id
    except (OSError, CorruptCheckpointError):
        return False


def lost_store_but_committed(job: SaveJob, err: RankDeadError) -> bool:
    """(a rank that lost the store after reporting its data) Ask the storage; log when committed."""
    if not job.reported or not committed_on_storage(job):
        return False
    logger.warning(
        "shardsafe: rank %d lost the rendezvous store after its part of the save of %s was done (%s); the "
        "checkpoint is committed (its manifest carries save id %s), so this save succeeded",
        job.coord.rank if job.coord else 0,
        job.path,
        err,
        job.save_id,
    )
    return True


# ------------------------------------------------------------------------------------------ rank 0


def lead(job: SaveJob, coord: Coordinator, flat: FlatState, reports: list[dict[str, Any]]) -> None:
    """(rank 0, every report in) Decide, publish, acknowledge; see the module docstring."""
    mismatch = [r["rank"] for r in reports if r["fingerprint"] != reports[0]["fingerprint"]]
    if mismatch:
        raise CheckpointError(
            f"save of {job.path!r}: ranks {mismatch} passed a state with other keys, shapes or dtypes than rank "
            "0. Every rank must save the same structure (the same model and optimizer)."
        )
    blocks = sorted({r["block_bytes"] for r in reports})
    if blocks != [job.block_bytes]:
        raise CheckpointError(f"save of {job.path!r}: ranks wrote with checksum block sizes {blocks}")
    fault_point("save.commit", coord.global_rank)
    manifest = job._manifest(coord, flat, reports)
    raw = manifest.to_bytes()
    where = job.storage.join(job.path, MANIFEST_NAME)
    try:
        parse_manifest(raw, where)  # what a loader will read: never publish what it would refuse
    except CorruptCheckpointError as err:
        raise CheckpointError(f"save of {job.path!r}: the manifest built from the reports does not validate: {err}")
    if manifest.refs:  # an incremental save: the files it refers to are still there (not deleted meanwhile)
        check_ref_files(job.storage, job.path, manifest)
    job.storage.set_deadline(time.monotonic() + job.deadlines.io)  # the barrier may have used up the first
    commit = Commit(job.staging, job.path, job.save_id, raw)
    job.storage.stage_manifest(commit)
    job.phase = "decide"
    outcome = coord.decide(COMMIT)
    if outcome != COMMIT:
        raise coord.remote_failure() or coord.error_from(json.loads(outcome))
    job.phase = "publish"
    old = _publish(job, coord, commit)
    coord.post("published", json.dumps({"ok": True}))
    _remove_stale(job, old, raw, where)
    fault_point("save.confirm", coord.global_rank)
    job.phase = "acknowledge"
    coord.acknowledge(timeout=job.deadlines.arrive)
    total = sum(int(size) for r in reports for size, _, _ in r["files"].values())
    took = time.monotonic() - job.started
    logger.info(
        "shardsafe: saved %s (%.1f MiB, %d ranks, %s) in %.2fs (%.0f MiB/s; blocking %.2fs)",
        job.path,
        total / 2**20,
        coord.world_size,
        flat.strategy,
        took,
        total / 2**20 / max(took, 1e-9),
        job.blocking_seconds,
    )


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


def _publish(job: SaveJob, coord: Coordinator, commit: Commit) -> bytes | None:
    """(rank 0, "commit" won) Make the manifest visible under the io deadline; on failure, post the
    ``published`` error record, discard staging when the publish surely did not happen, and raise."""
    gate = _Gate()

    def work() -> bytes | None:
        fault_point("save.publish", coord.global_rank)
        if gate.cancelled:  # called off while this thread was held up: touch nothing
            raise TimeoutError("publish called off: the save's deadline passed")
        return job.storage.publish(commit, overwrite=job.options["overwrite"], at_commit=gate)

    io = IOThread(job.path, time.monotonic() + job.deadlines.io)
    try:
        return io.call("publishing the manifest", work)
    except BaseException as err:
        never = gate.cancel() if io.hung else not gate.passed
        if not never and not io.hung and committed_on_storage(job):
            logger.warning("shardsafe: publishing %s raised (%s), but it is committed", job.path, err)
            return None
        if not io.hung and not is_remote(job.path):
            never = True  # a local rename that raised did not happen
        state = "nothing was committed" if never else "it may still become committed if the storage recovers"
        record = {"error": f"{type(err).__name__}: {err} ({state})", "rank": coord.global_rank, "phase": "publish"}
        try:
            coord.post("published", json.dumps(record))
        except RankDeadError as lost:
            logger.error("shardsafe: could not tell the ranks that publishing %s failed: %s", job.path, lost)
        if never:
            discard(job)
            raise
        raise CheckpointError(
            f"save of {job.path!r}: rank 0's publish did not complete ({type(err).__name__}: {err}); it may still "
            f"complete if the storage recovers: the checkpoint is committed iff {MANIFEST_NAME} there carries save id "
            f"{job.save_id}. Check the storage, then save again."
        ) from err
    finally:
        io.stop()


def _remove_stale(job: SaveJob, old: bytes | None, new: bytes, where: str) -> None:
    """(rank 0, committed) Remove the data files of the replaced checkpoint that the new manifest
    does not list (taken from the old manifest, validated), then what only the old manifest referred
    to in sibling checkpoints (:func:`~shardsafe.storage.delete.release_references`). A failure
    leaves unreferenced files."""
    began = time.monotonic()
    stale = stale_files(old, new, where)
    if old is None:
        return

    def remove() -> None:
        delete_files(job.storage, job.path, stale)
        release_references(job.storage, job.path, old, where)

    try:
        run_bounded("removing the old data files", job.path, time.monotonic() + job.deadlines.io, remove)
    except (OSError, ValueError) as err:
        logger.warning("shardsafe: committed %s but could not remove old data files %s: %s", job.path, stale, err)
    logger.debug(
        "shardsafe: save %s rank 0: removed %d replaced file(s) in %.3fs",
        job.path,
        len(stale),
        time.monotonic() - began,
    )


# ---------------------------------------------------------------------------------- other ranks


def follow(job: SaveJob, coord: Coordinator) -> None:
    """(ranks other than 0, report posted) Learn the outcome; see the module docstring."""
    job.phase = "decision"
    try:
        outcome = coord.await_value("decision", timeout=job.deadlines.io)
        if outcome is None:
            gave_up: CoordinationError = RankTimeoutError(
                f"save of {job.path!r}: rank {coord.rank} waited {job.deadlines.io:.0f}s for rank 0 to decide "
                "commit or abort after every rank had written its data. Raise timeout= or SHARDSAFE_IO_TIMEOUT if "
                "rank 0 is merely slow.",
                missing_ranks=[0],
            )
            outcome = _give_up(job, coord, gave_up)
    except RankDeadError as dead:
        if dead.store_lost:
            raise
        outcome = _give_up(job, coord, dead)
    if outcome != COMMIT:
        raise coord.remote_failure() or coord.error_from(json.loads(outcome))
    job.phase = "publish"
    wait = job.deadlines.io + job.deadlines.arrive  # outlasts rank 0's publish, which stops at io
    try:
        published = coord.await_value("published", timeout=wait)
    except RankDeadError as dead:
        _ask_storage(job, dead)
        return
    if published is None:
        _ask_storage(
            job,
            RankTimeoutError(
                f"save of {job.path!r}: rank 0 decided to commit but did not report its publish within {wait:.0f}s, "
                "and the checkpoint is not committed; it may still appear if rank 0's storage recovers",
                missing_ranks=[0],
            ),
        )
        return
    record = json.loads(published)
    if "error" in record:
        raise RemoteRankError(
            f"save of {job.path!r} failed on rank {record['rank']} in phase {record['phase']!r}: {record['error']}",
            rank=record["rank"],
            phase=record["phase"],
            cause=record["error"],
        )
    fault_point("save.confirm", coord.global_rank)
    coord.acknowledge(timeout=job.deadlines.arrive)


def _give_up(job: SaveJob, coord: Coordinator, err: CoordinationError) -> str:
    """Propose "abort" after ``err``; return the outcome ("commit" if rank 0 won first)."""
    blame = 0 if isinstance(err, RankDeadError) else None  # rank 0 found dead, or this rank gave up
    coord.fail(job.phase, err, rank=blame)
    outcome = coord.decide(abort_record(coord.global_rank if blame is None else blame, job.phase, err))
    if outcome != COMMIT and coord.remote_failure() is None:
        raise err
    return outcome


def _ask_storage(job: SaveJob, err: CoordinationError) -> None:
    """ "commit" won but rank 0 cannot confirm the publish: the storage says whether it happened."""
    if committed_on_storage(job):
        logger.warning(
            "shardsafe: rank %d did not hear from rank 0 after the commit decision (%s), but %s is committed with "
            "save id %s; this save succeeded",
            job.coord.rank if job.coord else 0,
            err,
            job.path,
            job.save_id,
        )
        return
    raise err
