"""The save protocol (DESIGN.md). One :class:`SaveJob` per save; a synchronous save runs both halves
inline, an asynchronous one runs :meth:`SaveJob.finish` on a background thread.

(all ranks) ``begin``: rendezvous; rank 0 checks the target (absent, empty, or shardsafe's own
    files only), picks the save id and the checksum block size, creates staging and broadcasts them;
    plan locally; stage (:mod:`shardsafe.engine.staging`; async: copy this rank's share into one
    reusable slab).
(all ranks) ``finish``: write this rank's data file (checksums while writing, fsync, under the
    deadline), report to the store; then the commit protocol of :mod:`shardsafe.engine.commit`: one
    decision per save, settled by the first ``compare_set`` on the decision key; rank 0 publishes only
    after winning "commit", staging is discarded only where "abort" won; every rank acknowledges the
    outcome and rank 0 returns last. On any failure before the decision every rank raises and the
    target is untouched.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

import torch

from shardsafe import knobs
from shardsafe.coord import Coordinator, Deadlines, fault_point
from shardsafe.engine import commit, incremental, staging
from shardsafe.engine.options import SaveOptions
from shardsafe.engine.phases import PhaseLog
from shardsafe.engine.plan import PendingChunk, own_chunks, plan_writes
from shardsafe.engine.progress import file_bytes
from shardsafe.engine.tracker import Tracker
from shardsafe.errors import (
    CheckpointError,
    CheckpointExistsError,
    CoordinationError,
    OperationTimeoutError,
    RankDeadError,
    RemoteRankError,
    UnsafeValueError,
)
from shardsafe.format.datafile import write_file
from shardsafe.format.manifest import Chunk, FileEntry, Manifest, TensorEntry
from shardsafe.format.values import encode
from shardsafe.state import per_rank
from shardsafe.state.flatten import FlatState, flatten
from shardsafe.storage import Storage, Writer, get_storage
from shardsafe.storage.names import refusal

logger = logging.getLogger(__name__)


class SaveJob:
    """One save of ``state`` to ``path``; see the module docstring for the call order."""

    def __init__(self, path: str, state: Mapping[str, Any], options: SaveOptions, deadlines: Deadlines) -> None:
        """``options``: complete (:func:`shardsafe.engine.options.complete`); ``deadlines`` resolved
        from its ``timeout``."""
        self.path = str(path)
        self.options = options  # its "base": rank 0's applies: it checks it and tells every rank
        self.base_name = ""
        self.base_manifest: Manifest | None = None
        self.ref_chunks: list[tuple[str, Chunk]] = []  # (tensor, reference) for chunks the base holds
        self.state = state
        self.deadlines = deadlines
        self.storage: Storage = get_storage(self.path, options["storage_options"])
        self.coord: Coordinator | None = None
        self.phases = PhaseLog("save", self.path, "rendezvous")
        self.save_id = ""
        self.staging = ""
        self.block_bytes = 0  # rank 0's choice, the same for every writer of this save
        self.reported = False  # this rank's report is on the store: only the storage may tell an outcome now
        self.flat: FlatState | None = None
        self.metadata_json: Any = None
        self.chunks: list[PendingChunk] = []
        self.staged: staging.Staged | None = None
        self.started = time.monotonic()
        self.blocking_seconds = 0.0
        self.tracker = Tracker("save", self.path, options["progress"])  # engine/tracker.py
        self.header_bytes = 0

    @property
    def phase(self) -> str:
        """The protocol phase this rank is in (named in errors and stall reports)."""
        return self.phases.phase

    @phase.setter
    def phase(self, name: str) -> None:
        self.phases.enter(name, None if self.coord is None else self.coord.global_rank)

    # ------------------------------------------------------------------------------------ begin

    def begin(self, *, copy: bool) -> None:
        """(all ranks, caller's thread) Rendezvous, plan and stage. With ``copy`` the chunks are copied
        into staging buffers, so the caller may change its tensors as soon as this returns."""
        self.coord = coord = Coordinator.join(
            "save", self.path, deadlines=self.deadlines, group=self.options["group"], heartbeat=True
        )
        self.tracker.start(coord, lambda: self.phase)
        try:
            fault_point("save.rendezvous", coord.global_rank)
            self.phase = "plan"
            decision = None
            if coord.rank == 0:
                decision = self._choose_save_id()
            record = json.loads(coord.broadcast("save_id", decision, timeout=self.deadlines.arrive))
            if "exists" in record:
                raise CheckpointExistsError(record["exists"])
            if "base_error" in record:
                raise incremental.BaseRefusedError(record["base_error"])
            self.save_id, self.staging = record["save_id"], record["staging"]
            self.block_bytes = int(record["block_bytes"])
            if "base" in record:
                self.base_name = record["base_name"]
                self.base_manifest = incremental.read_base(self.storage, record["base"], record["base_sid"])
            # gather: FSDP1 hook (state/fsdp1.py), every rank's payload through the store, used only for
            # FSDP1 optimizers with use_orig_params=True (a rank may hold no state for some parameters)
            self.flat = flatten(
                self.state,
                allow_pickle=self.options["allow_pickle"],
                gather=lambda phase, payload: coord.barrier(
                    phase, payload, timeout=self.deadlines.arrive, collect=True
                ),
            )
            per_rank.find_per_rank(self.flat, coord, self.deadlines)
            self.metadata_json = encode(self.options["metadata"], "metadata", _no_tensors)
            self.chunks = plan_writes(self.flat.items, coord.rank, coord.world_size) + own_chunks(self.flat)
            if self.base_manifest is not None:
                self.chunks, self.ref_chunks = incremental.match(
                    self.chunks,
                    self.base_manifest,
                    self.base_name,
                    self.block_bytes,
                    self.storage,
                    self.path,
                    self.deadlines.io,
                )
            size, self.header_bytes = file_bytes(self.chunks)  # what this rank writes (references excluded)
            self.tracker.set_total(size)
            fault_point("save.plan", coord.global_rank)
            self.phase = "stage"
            self.staged = staging.stage(self.chunks, snapshot=copy, wait=self.deadlines.io)
            self.chunks = self.staged.chunks  # after a snapshot, no reference to the caller's tensors
            if copy:
                fault_point("save.stage", coord.global_rank)
        except BaseException as err:
            wrapped = self._failed(err)
            self.tracker.end(wrapped)
            coord.close()
            self._release()
            if wrapped is err:
                raise
            raise wrapped from err
        self.blocking_seconds = time.monotonic() - self.started

    def _choose_save_id(self) -> str:
        """(rank 0) Refuse a target that is neither absent, nor empty, nor shardsafe's own (a
        committed one without ``overwrite`` included), changing nothing; else a fresh save id, its
        staging, and the checksum block size every writer uses (rank 0's, so ranks configured
        differently still write one loadable checkpoint)."""
        self.storage.set_deadline(time.monotonic() + self.deadlines.arrive)
        why = refusal(self.storage, self.path, overwrite=self.options["overwrite"])
        if why is not None:
            return json.dumps({"exists": why})
        base: dict[str, Any] = {}
        if self.options["base"] is not None:
            base = json.loads(incremental.check_base(self.storage, self.path, os.fspath(self.options["base"])))
            if "base_error" in base:
                return json.dumps(base)
        self.save_id = f"{int(time.time())}{uuid.uuid4().hex[:10]}"
        self.staging = self.storage.staging_dir(self.path, self.save_id)
        self.storage.prepare_staging(self.staging)
        return json.dumps(
            {"save_id": self.save_id, "staging": self.staging, "block_bytes": knobs.checksum_block_bytes(), **base}
        )

    # ----------------------------------------------------------------------------------- finish

    def finish(self) -> None:
        """(all ranks; caller's thread or the background thread) Write, report, commit, confirm."""
        coord, flat = self.coord, self.flat
        assert coord is not None and flat is not None
        writer: Writer | None = None
        error: BaseException | None = None
        self.storage.set_deadline(time.monotonic() + self.deadlines.io)
        try:
            self.phase = "write"
            report: dict[str, Any] = {
                "rank": coord.rank,
                "chunks": [],
                "files": {},
                "fingerprint": _fingerprint(flat),
                "block_bytes": self.block_bytes,
                "per_rank": per_rank.report(flat),
            }
            if self.chunks:
                name = f"data-{coord.rank:05d}-{self.save_id}.safetensors"
                writer = self.storage.open_writer(self.storage.join(self.staging, name))
                assert self.staged is not None
                entry, records = write_file(
                    writer,
                    name,
                    self.chunks,
                    self.block_bytes,
                    lambda: fault_point("save.write", coord.global_rank),
                    self.tracker.counted(staging.windows(self.staged), self.header_bytes),
                )
                w, writer = writer, None
                w.close()
                report["files"][name] = [entry.size, entry.header_bytes, entry.header_checksum]
                report["chunks"] = [[c.name, r.to_json()] for c, r in zip(self.chunks, records, strict=True)]
            report["chunks"] += [[name, c.to_json()] for name, c in self.ref_chunks]
            fault_point("save.report", coord.global_rank)
            self.phase = "report"
            self.tracker.flush()
            self.reported = True
            reports = coord.barrier("written", json.dumps(report), timeout=self.deadlines.io, collect=coord.rank == 0)
            self.phase = "commit"
            if coord.rank == 0:
                commit.lead(self, coord, flat, [json.loads(r) for r in reports])
            else:
                commit.follow(self, coord)
        except BaseException as err:
            if writer is not None:
                writer.abort()
            if isinstance(err, RankDeadError) and err.store_lost and commit.lost_store_but_committed(self, err):
                return  # the store went away after this rank's part was done, and the checkpoint is committed
            error = wrapped = self._failed(err)
            if wrapped is err:
                raise
            raise wrapped from err
        finally:
            self.tracker.end(error)  # before close: rank 0's final record reads this save's keys
            coord.close()
            self._release()
            self.phase = "done"

    def _release(self) -> None:
        self.chunks = []
        self.ref_chunks = []
        if self.staged is not None:
            self.staged.close()
            self.staged = None

    def _manifest(self, coord: Coordinator, flat: FlatState, reports: list[dict[str, Any]]) -> Manifest:
        chunks: dict[str, list[Chunk]] = {}
        files: dict[str, FileEntry] = {}
        for report in reports:
            for fname, (size, header_bytes, header_sum) in report["files"].items():
                files[fname] = FileEntry(size, header_bytes, header_sum)
            for name, c in report["chunks"]:
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
        own = per_rank.merge_reports(flat, reports, chunks)
        tensors = {}
        for item in flat.items:
            mine = sorted(chunks.get(item.name, []), key=lambda c: c.offsets)
            if sum(math.prod(c.sizes) for c in mine) != math.prod(item.shape):
                raise CheckpointError(
                    f"save of {self.path!r}: tensor {item.name!r} was not fully written by the ranks "
                    "(planning differed "
                    "between ranks); every rank must pass the same state structure"
                )
            tensors[item.name] = TensorEntry(item.local.dtype, item.shape, tuple(mine))
        tensors.update(own)
        from shardsafe.version import __version__

        return Manifest(
            save_id=self.save_id,
            created=time.time(),
            world_size=coord.world_size,
            strategy=flat.strategy,
            library={"shardsafe": __version__, "torch": torch.__version__.split("+")[0]},
            block_bytes=self.block_bytes,
            metadata=self.metadata_json,
            objects=flat.objects,
            tensors=tensors,
            files=files,
            refs=incremental.ref_table(self.base_manifest, self.base_name, [c for cs in chunks.values() for c in cs])
            if self.base_manifest is not None
            else {},
        )

    # ---------------------------------------------------------------------------------- failure

    def _failed(self, err: BaseException) -> BaseException:
        """(the rank that caught ``err``) Tell the other ranks, propose "abort" on the decision key, and
        where abort is the outcome remove what this save wrote (every rank: the removal is idempotent).
        Where "commit" won first (this rank failed after the decision), nothing is removed. Returns
        the error to raise. When another rank failed first, a local error that follows from it (e.g.
        the staging directory vanished under this rank's writer) is reported as that rank's failure."""
        coord = self.coord
        if coord is None:
            return err
        remote: BaseException | None = None
        outcome: str | None = None
        try:
            remote = coord.remote_failure() if not isinstance(err, CoordinationError) else None
            if remote is None and not isinstance(
                err, (RemoteRankError, CheckpointExistsError, incremental.BaseRefusedError)
            ):
                coord.fail(self.phase, err)
            outcome = coord.decide(commit.abort_record(coord.global_rank, self.phase, err))
        except RankDeadError as lost:  # no store: the outcome is unknown unless nobody could commit yet
            logger.debug("shardsafe: rank %d could not settle the outcome of %s: %s", coord.rank, self.path, lost)
        if outcome is None and not self.reported:
            outcome = "abort"  # without this rank's report no commit is possible
        if self.staging and outcome is not None and outcome != commit.COMMIT:
            commit.discard(self)
        if remote is not None:
            return remote
        return self._wrap(err)

    def _wrap(self, err: BaseException) -> BaseException:
        if isinstance(err, (CheckpointError, CoordinationError)) or not isinstance(err, Exception):
            return err
        rank = self.coord.global_rank if self.coord else 0
        return CheckpointError(
            f"save of {self.path!r} failed on rank {rank} in phase {self.phase!r}: {type(err).__name__}: {err}. "
            "Nothing was committed; the previous checkpoint (if any) is untouched. Fix the cause and save again."
        )


def _fingerprint(flat: FlatState) -> str:
    import hashlib

    h = hashlib.sha256()
    for item in flat.items:
        h.update(f"{item.name}|{item.shape}|{item.local.dtype}|{item.replicated};".encode())
    return h.hexdigest()[:16]


def _no_tensors(path: str, _t: torch.Tensor) -> str:
    raise UnsafeValueError(f"{path!r}: metadata= holds plain values only (no tensors); put tensors in the state")


class SaveHandle:
    """A save in progress. ``wait()`` returns once the checkpoint is committed on every rank, or raises
    the save's error (on every rank)."""

    def __init__(self, job: SaveJob, thread: threading.Thread | None) -> None:
        self.job = job
        self._thread = thread
        self._error: BaseException | None = None
        self._reported = False

    @property
    def path(self) -> str:
        return self.job.path

    def _run(self) -> None:
        try:
            self.job.finish()
        except BaseException as err:  # kept and raised by wait() / the next save; never swallowed
            self._error = err

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def exception(self) -> BaseException | None:
        return self._error if self.done() else None

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save is committed (or failed); ``timeout`` seconds at most (default: the
        bound of the save's own waits, :func:`~shardsafe.engine.commit.finish_bound`, plus a margin)."""
        if self._thread is not None:
            limit = (
                timeout
                if timeout is not None
                else commit.finish_bound(self.job.deadlines) + knobs.wait_margin_seconds()
            )
            self._thread.join(limit)
            if self._thread.is_alive():
                raise OperationTimeoutError(
                    f"save of {self.job.path!r} still running after {limit:.0f}s (phase {self.job.phase!r}); "
                    "call wait() again or raise the timeout"
                )
        if self._error is not None:
            self._reported = True
            raise self._error
