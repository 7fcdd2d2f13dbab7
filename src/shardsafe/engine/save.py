"""The save protocol. One :class:`SaveJob` per save; a synchronous save runs both halves inline, an
asynchronous one runs :meth:`SaveJob.finish` on a background thread.

(all ranks) ``begin``: flatten the state locally (and, with other ranks, digest its values for the
    per-rank check); rank 0 checks the target (absent, empty, or shardsafe's own files only), picks the
    save id and the checksum block size and creates the pending directory; then the first agreement,
    ``arrive``: every rank sends its digests (:class:`~shardsafe.engine.messages.SaveArrival`), rank 0
    decides the :class:`~shardsafe.engine.messages.SaveStart` (save id, staging, per-rank subtrees,
    base). Then plan locally and stage (async: copy this rank's share into one reusable slab). With
    ``staging="background"``, ``begin`` only captures the state (:mod:`shardsafe.engine.snapshot`) and
    all of this runs at the start of ``finish``, on the save's thread.
(all ranks) ``finish``: with ``staging="background"``, the above, then copy this rank's share (a tensor
    changed since the call fails the save on every rank); then write this rank's data file (checksums
    while writing, fsync, under the deadline), then the commit protocol of :mod:`shardsafe.engine.commit`:
    the second agreement, ``written``, with one decision per save, settled by the first ``compare_set``
    on the decision key; rank 0 publishes only after winning "go", the pending directory is discarded
    only where an abort won; every rank acknowledges the outcome and rank 0 returns last. On any failure
    before the decision every rank raises the same error and the target is untouched.

Two agreements in the common case; a third (``per_rank``) only when some values differ between ranks
and their node tables were too large to send with the first, or when an FSDP1 optimizer over original
parameters needs the exchange of :func:`~shardsafe.state.flatten.exchange_payload` first.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

import torch

from shardsafe import knobs
from shardsafe.catalog.names import refusal
from shardsafe.catalog.publish import CheckpointPublication
from shardsafe.coord import Clock, Operation, fault_point
from shardsafe.engine import commit, hostmem, incremental, replicas, sidefiles, snapshot, staging
from shardsafe.engine.messages import (
    CHANNEL,
    SAVE_ARRIVE,
    SAVE_PER_RANK,
    Base,
    PerRankNodes,
    PerRankPaths,
    SaveArrival,
    SaveStart,
    WriteReport,
)
from shardsafe.engine.options import SaveOptions
from shardsafe.engine.phases import PhaseLog
from shardsafe.engine.plan import PendingChunk, Rules, file_bytes, plan_save
from shardsafe.errors import CheckpointExistsError, OperationTimeoutError, UnsafeValueError
from shardsafe.format.datafile import write_file
from shardsafe.format.manifest import Chunk, Manifest
from shardsafe.format.names import data_file
from shardsafe.format.values import encode
from shardsafe.progress.tracker import Tracker
from shardsafe.state import per_rank
from shardsafe.state.flatten import Captured, FlatState, capture, exchange_payload, flatten
from shardsafe.storage import Storage, Writer, get_storage

logger = logging.getLogger(__name__)


class SaveJob:
    """One save of ``state`` to ``path``; see the module docstring for the call order."""

    def __init__(self, path: str, state: Mapping[str, Any], options: SaveOptions, clock: Clock) -> None:
        """``options``: complete (:func:`shardsafe.engine.options.complete`); ``clock``: the call's
        deadlines, taken when it started."""
        self.path = str(path)
        self.options = options  # its "base": rank 0's applies: it checks it and tells every rank
        self.state = state
        self.clock = clock
        self.storage: Storage = get_storage(self.path, options["storage_options"], deadline=clock.end)
        self.op: Operation | None = None
        self.phases = PhaseLog("save", self.path, "rendezvous")
        self.save_id = ""
        self.pending = ""
        self.block_bytes = 0  # rank 0's choice, the same for every writer of this save
        self.base_name = ""
        self.base_manifest: Manifest | None = None
        self.ref_chunks: list[tuple[str, Chunk]] = []  # (tensor, reference) for chunks the base holds
        self.replicas: list[str] = []  # digests of this rank's replicated tensors (engine/replicas.py)
        self.flat: FlatState | None = None
        self.captured: Captured | None = None  # staging="background": the state as the call read it, until encoded
        self.metadata_json: Any = None
        self.chunks: list[PendingChunk] = []
        self.rules = Rules()  # the tensors described by a sharding rule (format v3): their chunks are not reported
        self.ruled = 0  # the last chunks of self.chunks are those a rule describes (written as the file's region)
        self.staged: staging.Staged | None = None
        self.background: snapshot.BackgroundStaging | None = None  # staging="background": copies still to make
        self.started = time.monotonic()
        self.blocking_seconds = 0.0
        self.tracker = Tracker("save", self.path, options["progress"])  # progress/tracker.py
        self.header_bytes = 0
        self._refused: BaseException | None = None  # rank 0: the target or base refused (decided for all)
        self._prepared = False  # rank 0 created staging
        self.deferred = False  # staging="background" captured the state at the call; finish() starts the save
        self._captured_failure: BaseException | None = None  # the capture's failure, sent in the rendezvous
        self.side: sidefiles.SideWriter | None = None  # rank 0: the side files it wrote

    @property
    def phase(self) -> str:
        """The protocol phase this rank is in (named in errors and stall reports)."""
        return self.phases.phase

    @phase.setter
    def phase(self, name: str) -> None:
        self.phases.enter(name, None if self.op is None else self.op.global_rank)

    # ------------------------------------------------------------------------------------ begin

    def begin(self, *, copy: bool, defer: bool = False) -> None:
        """(all ranks, caller's thread) Rendezvous, plan and stage. With ``copy`` the chunks are copied
        into staging buffers, so the caller may change its tensors as soon as this returns; with
        ``defer`` too (``staging="background"``), only the state is captured here (flattened, its plain
        values encoded, its tensors' versions recorded, the optimizers gated: :mod:`~shardsafe.engine.snapshot`)
        and :meth:`finish` does the rest on the save's thread: rendezvous, plan, copies."""
        self.op = op = Operation.begin("save", self.path, self.clock, channel=CHANNEL, group=self.options["group"])
        self.deferred = defer and self._capture(op)
        if not self.deferred:  # else the save's thread starts progress reporting, with the rest of the save
            self.tracker.start(op, lambda: self.phase)
            self._start(op, copy=copy, defer=defer)
        self.blocking_seconds = time.monotonic() - self.started

    def _capture(self, op: Operation) -> bool:
        """(staging="background", the caller's thread) Flatten the state and capture it for background
        staging; False where the start must come first (an FSDP1 exchange, which the rendezvous carries)
        or the capture failed: then the rendezvous, at the call, carries the failure to every rank."""
        try:
            self.captured = capture(self.state, allow_pickle=self.options["allow_pickle"], gather=_exchange_first)
            self.metadata_json = encode(self.options["metadata"], "metadata", _no_tensors)
            c = self.captured
            self.background = snapshot.BackgroundStaging(
                c.items, c.leaves, c.buffers, self.state, path=self.path, rank=op.rank
            )
            self.background.attach(self.clock.work)
        except _ExchangeFirst:
            return False
        except Exception as err:  # raised on every rank by the rendezvous (_rendezvous sends it)
            self._captured_failure = err
            if self.background is not None:
                self.background.close()
            return False
        return True

    def _start(self, op: Operation, *, copy: bool, defer: bool) -> None:
        """(all ranks; the caller's thread, or the save's after a capture) The rendezvous, the plan and
        the staging; a failure is settled with every rank (the commit round) and raised."""
        try:
            start = self._rendezvous(op)
            fault_point("save.rendezvous", op.global_rank)
            self.phase = "plan"
            self.save_id, self.pending, self.block_bytes = start.save_id, start.pending, start.block_bytes
            if start.base is not None:
                self.base_name = start.base.name
                self.base_manifest = incremental.read_base(
                    self.storage.within(self.clock.work), start.base.path, start.base.save_id
                )
            if self.flat is None:  # the FSDP1 exchange came with the first agreement
                payloads = [p for p in start.fsdp1 if p]
                self.flat = flatten(
                    self.state, allow_pickle=self.options["allow_pickle"], gather=lambda _phase, _mine: payloads
                )
            if copy and defer and self.background is None:  # captured now, the start having come first
                flat = self.flat
                self.background = snapshot.BackgroundStaging(
                    flat.items, [], flat.buffers, self.state, path=self.path, rank=op.rank
                )
                self.background.attach(self.clock.work)
            paths = start.per_rank if start.per_rank is not None else self._per_rank_round(op, start.differ)
            per_rank.apply(self.flat, paths, op.rank)
            if not self.deferred:
                self.metadata_json = encode(self.options["metadata"], "metadata", _no_tensors)
                if not op.single:  # before the call returns: what an async save copies (engine/replicas.py)
                    self.replicas = replicas.digests(self.flat)
            plan = plan_save(self.flat, op.rank, op.world_size, ruled=not start.base and _whole_world(op.world_size))
            self.chunks, self.rules, self.ruled = plan.chunks, plan.rules, plan.ruled
            if self.base_manifest is not None:
                if self.background is not None:
                    self.background.check_memory(self.flat)  # before the comparison reads its tensors
                self.chunks, self.ref_chunks = incremental.match(
                    self.chunks,
                    self.base_manifest,
                    self.base_name,
                    self.block_bytes,
                    self.storage.within(self.clock.work),
                    self.path,
                    self.clock.work,
                )
            size, self.header_bytes = file_bytes(self.chunks, self.block_bytes, self.ruled)  # references excluded
            self.tracker.set_total(size)
            fault_point("save.plan", op.global_rank)
            self.phase = "stage"
            if self.background is not None:
                self.background.plan(self.flat, self.chunks)
                self.background.check_unchanged([name for name, _ in self.ref_chunks])
                self.staged = staging.stage(
                    self.background.chunks,
                    snapshot=True,
                    wait=self.clock.work.remaining(),
                    defer=True,
                    marks=self.background.marks,
                )
            else:
                self.staged = staging.stage(self.chunks, snapshot=copy, wait=self.clock.work.remaining())
                self.chunks = self.staged.chunks  # after a snapshot, no reference to the caller's tensors
                if copy:
                    fault_point("save.stage", op.global_rank)
        except BaseException as err:
            self._release()
            if op.outcome_known:  # the same outcome every rank got: nothing more to tell
                self._end(err)
                raise
            try:  # a local failure after the rendezvous: every rank learns it through the commit round
                self._commit(None, err)
            except BaseException as settled:
                self._end(settled)
                raise
            raise  # not reached: the commit round raises for a failure

    def _rendezvous(self, op: Operation) -> SaveStart:
        """(every rank) Flatten (unless captured) and digest locally (rank 0 also prepares the target),
        then the first agreement. Raises the rendezvous' failure on every rank."""
        body: SaveArrival | None = None
        failure: BaseException | None = self._captured_failure
        if failure is None and self.captured is not None:  # encode what the call captured (background)
            assert self.background is not None
            try:
                self.flat = self.captured.finish(self.background.substitutes)
                self.background.check_memory(self.flat)  # before the digests read its tensors
            except Exception as err:  # sent to every rank in the agreement; raised on every rank
                failure = err
            self.captured = None
        try:
            if failure is not None:
                pass  # the capture (or its encoding) failed: every rank learns it from this agreement
            elif self.flat is None and (payload := exchange_payload(self.state)):
                body = SaveArrival({}, {}, payload)
            else:
                if self.flat is None:
                    self.flat = flatten(self.state, allow_pickle=self.options["allow_pickle"])
                entries, nodes = per_rank.digests(self.flat) if not op.single else ({}, {})  # alone: none differ
                body = SaveArrival(entries, nodes, "")
            if op.rank == 0 and failure is None:
                self._prepare()
        except Exception as err:  # sent to every rank in the agreement; raised on every rank
            failure = err
        try:
            return op.agree(SAVE_ARRIVE, body, self._decide_start, failure=failure)
        except BaseException:
            self._discard_prepared(op)
            raise

    def _prepare(self) -> None:
        """(rank 0, before the rendezvous) Refuse a target that is neither absent, nor empty, nor
        shardsafe's own (a committed one without ``overwrite`` included), changing nothing; check the
        base; else a fresh save id, its staging, and the checksum block size every writer uses (rank 0's,
        so ranks configured differently still write one loadable checkpoint). A refusal is kept and
        decided for every rank once all have arrived."""
        storage = self.storage.within(self.clock.arrive)  # every rank is there by then
        side = bool(self.options["files"]) or self.options["write_files"] is not None  # rank 0's: the writer's
        why = refusal(storage, self.path, overwrite=self.options["overwrite"], side_files=side)
        if why is not None:
            self._refused = CheckpointExistsError(why)
            return
        self._base: Base | None = None
        chosen = self.options["base"]
        if callable(chosen):  # rank 0 chooses now (the manager: from what the root holds)
            chosen = chosen()
        if chosen is not None:
            import json

            checked = json.loads(incremental.check_base(storage, self.path, os.fspath(chosen)))
            if "base_error" in checked:
                self._refused = incremental.BaseRefusedError(checked["base_error"])
                return
            self._base = Base(checked["base"], checked["base_name"], checked["base_sid"])
        self.save_id = f"{int(time.time())}{uuid.uuid4().hex[:10]}"
        publication = CheckpointPublication(self.storage, self.path, self.save_id)  # write hidden, ...
        self.pending = publication.pending
        publication.hide(self.clock.arrive)
        self._prepared = True
        self.block_bytes = knobs.checksum_block_bytes()

    def _decide_start(self, arrivals: dict[int, SaveArrival]) -> SaveStart:
        """(rank 0, every arrival in) The save's start, the same for every rank."""
        if self._refused is not None:
            raise self._refused
        assert self.flat is not None or any(a.fsdp1 for a in arrivals.values())
        bodies = [arrivals[r] for r in range(len(arrivals))]
        fsdp1 = [b.fsdp1 for b in bodies]
        paths: list[list[Any]] | None
        differ: list[str]
        if self.op is not None and self.op.single:
            paths, differ = [], []
        elif any(fsdp1) or self.flat is None:
            paths, differ = None, []  # the values are digested after the exchange, in a round of their own
        else:
            paths, differ = per_rank.decide(
                self.flat, [b.entries for b in bodies], [b.nodes for b in bodies], self.path
            )
        return SaveStart(self.save_id, self.pending, self.block_bytes, self._base, paths, differ, fsdp1)

    def _per_rank_round(self, op: Operation, differ: list[str]) -> list[list[Any]]:
        """(every rank, only when the first agreement could not decide) The per-rank subtrees, from every
        rank's node tables: of ``differ``, or of every value entry when ``differ`` is empty (after the
        FSDP1 exchange)."""
        flat = self.flat
        assert flat is not None
        if differ:
            body = PerRankNodes({}, per_rank.nodes_of(flat, differ))
        else:
            entries, _ = per_rank.digests(flat)
            body = PerRankNodes(entries, per_rank.nodes_of(flat, [k for k, v in entries.items() if v[1]]))

        def decide(messages: dict[int, PerRankNodes]) -> PerRankPaths:
            tables = [messages[r] for r in range(len(messages))]
            keys = differ
            if not keys:
                _, keys = per_rank.decide(flat, [t.entries for t in tables], [None for _ in tables], self.path)
                if not keys:
                    return PerRankPaths([])
            return PerRankPaths(per_rank.paths(flat, keys, [t.nodes for t in tables]))

        return op.agree(SAVE_PER_RANK, body, decide).paths

    def _discard_prepared(self, op: Operation) -> None:
        """(rank 0) The rendezvous failed: remove the staging it created (nothing else was written)."""
        if op.rank == 0 and self._prepared:
            commit.discard(
                self.storage,
                self.path,
                self.pending,
                self.save_id,
                op.world_size,
                self.clock.arrive.or_grace(),
                remember=True,
            )
            self._prepared = False

    # ----------------------------------------------------------------------------------- finish

    def finish(self) -> None:
        """(all ranks; caller's thread or the background thread) Write, then the commit round."""
        op = self.op
        assert op is not None
        if self.deferred:
            assert self.background is not None
            self.tracker.start(op, lambda: self.phase)
            hostmem.current_after(self.background.marks)  # the start reads small tensors (per-rank digests)
            self._start(op, copy=True, defer=True)
        flat = self.flat
        assert flat is not None
        writer: Writer | None = None
        report: WriteReport | None = None
        error: BaseException | None = None
        storage = self.storage.within(self.clock.work)  # this rank's own writes and fsyncs
        try:
            if self.background is not None:
                self.phase = "stage"
                assert self.staged is not None
                self.background.run(self.staged, lambda: fault_point("save.stage", op.global_rank))
                self.chunks = self.staged.chunks  # copied: no reference to the caller's tensors
            self.phase = "write"
            files: dict[str, list[Any]] = {}
            chunks: list[list[Any]] = []
            if self.chunks:
                name = data_file(op.rank, self.save_id)
                writer = storage.open_writer(storage.join(self.pending, name))
                assert self.staged is not None
                entry, records = write_file(
                    writer,
                    name,
                    self.chunks,
                    self.block_bytes,
                    lambda: fault_point("save.write", op.global_rank),
                    self.tracker.counted(staging.windows(self.staged), self.header_bytes),
                    self.ruled,
                )
                w, writer = writer, None
                w.close()
                files[name] = [entry.size, entry.header_bytes, entry.header_checksum, entry.index_checksum]
                ruled = self.rules.tensors  # their chunks follow from the rule and this file's index
                chunks = [
                    [c.name, r.to_json()] for c, r in zip(self.chunks, records, strict=True) if c.name not in ruled
                ]
            chunks += [[name, c.to_json()] for name, c in self.ref_chunks]
            side = self._write_side_files(op)
            fault_point("save.report", op.global_rank)
            self.phase = "report"
            report = WriteReport(
                chunks,
                files,
                _fingerprint(flat, self.rules),
                self.block_bytes,
                per_rank.report(flat),
                self.tracker.own_counts(),
                side,
                self.replicas,
            )
        except BaseException as err:
            error = err
            if writer is not None:
                try:
                    writer.abort()
                except OSError as gone:  # staging already removed (another rank's abort): nothing left to undo
                    logger.debug("shardsafe: rank %d: discarding its unfinished data file: %s", op.rank, gone)
        try:
            self._commit(report, error)
        except BaseException as err:
            self._end(err)
            raise
        self._end(None)

    def _write_side_files(self, op: Operation) -> dict[str, list[Any]]:
        """(every rank, its data file durable) Rank 0 writes the side files (``files=``, then ``write_files=``)
        into the pending directory and returns their sizes and checksums; the others return those of the
        ``files=`` they gave, which rank 0 compares with its own (:func:`~shardsafe.engine.sidefiles.merge`)."""
        files = self.options["files"] or {}
        if op.rank != 0:
            return sidefiles.digests(files)
        self.phase = "side_files"
        self.side = sidefiles.SideWriter(
            self.storage.within(self.clock.work),
            self.pending,
            self.path,
            lambda: fault_point("save.side_files", op.global_rank),
        )
        return self.side.write(files, self.options["write_files"])

    def _commit(self, report: WriteReport | None, error: BaseException | None) -> None:
        op = self.op
        assert op is not None
        self.phase = "commit" if error is None else self.phase
        flat = self.flat if self.flat is not None else FlatState(objects={}, items=[], strategy="plain")
        inputs = commit.CommitInputs(
            path=self.path,
            storage=self.storage,
            save_id=self.save_id,
            pending=self.pending,
            overwrite=self.options["overwrite"],
            block_bytes=self.block_bytes,
            flat=flat,
            metadata=self.metadata_json,
            base_manifest=self.base_manifest,
            base_name=self.base_name,
            rules=self.rules,
            started=self.started,
            blocking_seconds=self.blocking_seconds,
            side_written=tuple(self.side.written) if self.side is not None else (),
        )

        def set_phase(name: str) -> None:
            self.phase = name

        failed_in = "stage" if self.phase == "stage" else "write"  # where this rank's part failed
        commit.Committer(op, inputs, self.tracker, set_phase).run(report, error, failed_in)

    def _end(self, error: BaseException | None) -> None:
        """(every rank, once) The operation is over on this rank."""
        self.tracker.end(error)
        if self.op is not None:
            self.op.close()
        self._release()
        self.phase = "done"

    def _release(self) -> None:
        if self.background is not None:
            self.background.close()
        self.chunks = []
        self.ref_chunks = []
        if self.staged is not None:
            self.staged.close()
            self.staged = None


def _fingerprint(flat: FlatState, rules: Rules) -> str:
    import hashlib

    h = hashlib.sha256()
    for item in flat.items:
        h.update(f"{item.name}|{item.shape}|{item.local.dtype}|{item.replicated};".encode())
    h.update(rules.digest().encode())  # the sharding rules too: rank 0 builds the manifest from its own
    return h.hexdigest()[:16]


def _whole_world(world_size: int) -> bool:
    """Whether the saving group is the whole job (its ranks are the global ranks a DTensor's mesh
    names): only then are sharded tensors described by rules."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == world_size


class _ExchangeFirst(Exception):
    """The state holds an FSDP1 optimizer over original parameters: its flattening needs every rank's
    payload, which the rendezvous carries, so a background save cannot capture it before the start."""


def _exchange_first(_phase: str, _payload: str) -> list[str]:
    raise _ExchangeFirst


def _no_tensors(path: str, _t: torch.Tensor) -> str:
    raise UnsafeValueError(f"{path!r}: metadata= holds plain values only (no tensors); put tensors in the state")


_GO_AHEAD_SECONDS = 1.0
"""The longest a save's thread waits for :meth:`SaveHandle.launch` to hand it the interpreter lock."""


class SaveHandle:
    """A save in progress. ``wait()`` returns once the checkpoint is committed on every rank, or raises
    the save's error (on every rank)."""

    def __init__(self, job: SaveJob, thread: threading.Thread | None) -> None:
        self.job = job
        self._thread = thread
        self._error: BaseException | None = None
        self._error_seen = False
        self._go = threading.Event()  # set by the caller once it no longer needs the interpreter lock

    def launch(self) -> None:
        """(the caller's thread) Start the save's thread (given at construction) and return at once. The
        thread waits for the go-ahead this sets as the last step: a thread that starts running Python
        code keeps the interpreter lock for a whole switch interval (5 ms) while ``Thread.start``
        waits to take it back, which would be the largest part of the call's blocking time."""
        assert self._thread is not None
        self._thread.start()
        self._go.set()

    @property
    def path(self) -> str:
        return self.job.path

    def _run(self) -> None:
        self._go.wait(_GO_AHEAD_SECONDS)  # set at once by launch(); bounded, and the save runs either way
        try:
            self.job.finish()
        except BaseException as err:  # kept and raised by wait() / the next save; never swallowed
            self._error = err

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def staged(self) -> bool:
        """Whether this rank's copies are over (always, except with ``staging="background"`` while they
        run): from then on the caller's tensors may change freely. True also when staging failed; the
        failure is raised by :meth:`wait` (or the next call)."""
        background = self.job.background
        return background is None or background.done.is_set()

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until :meth:`staged`; ``timeout`` seconds at most (default: the save's work deadline
        plus a margin), else :class:`OperationTimeoutError`. Raises nothing about the save itself: its
        outcome, a failed staging included, is :meth:`wait`'s."""
        background = self.job.background
        if background is None:
            return
        limit = timeout if timeout is not None else self.job.clock.work.remaining() + knobs.wait_margin_seconds()
        if not background.done.wait(limit):
            raise OperationTimeoutError(
                f"background staging of {self.job.path!r} still copying after {limit:.0f}s (phase {self.job.phase!r}); "
                "call wait_staged() again or raise the timeout"
            )

    def exception(self) -> BaseException | None:
        return self._error if self.done() else None

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save is staged and committed (or failed); ``timeout`` seconds at most (default: what
        is left of the save's end deadline, plus ``SHARDSAFE_ERROR_REPORT_SECONDS`` and
        ``SHARDSAFE_WAIT_MARGIN_SECONDS``)."""
        if self._thread is not None:
            limit = (
                timeout
                if timeout is not None
                else self.job.clock.end.remaining() + knobs.error_report_seconds() + knobs.wait_margin_seconds()
            )
            self._thread.join(limit)
            if self._thread.is_alive():
                raise OperationTimeoutError(
                    f"save of {self.job.path!r} still running after {limit:.0f}s (phase {self.job.phase!r}); "
                    "call wait() again or raise the timeout"
                )
        if self._error is not None:
            self._error_seen = True
            raise self._error
