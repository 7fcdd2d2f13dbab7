"""The load protocol. (all ranks) read and validate the manifest; plan: match the caller's state with
the checkpoint (state/restore.py), checking every key, shape and dtype, the files' sizes, then
allocate what is new; then the first agreement, ``arrive``, which is also the go/no-go: only when every
rank planned and validated does any rank read the needed byte ranges, verified, into the destinations,
and restore modules, optimizers and stateful objects through their own load paths; then the second
agreement, ``loaded``: one outcome on every rank; then the acknowledgement.

All or nothing across ranks before any data is read: a rank that fails while planning sends its
failure in the first agreement, so a failure found before reading data (a missing key on one rank, a
shape, a dtype, a damaged manifest, a short file) raises on every rank with every rank's state
untouched. A failure while reading (a corrupt block) can leave tensors read before it loaded, on the
ranks that read them; every rank raises. A caller that must not see that verifies first
(``CheckpointManager.resume(state, verify=True)``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch

from shardsafe.coord import Clock, Operation, fault_point
from shardsafe.coord.messages import Empty
from shardsafe.engine.messages import CHANNEL, LOAD_ARRIVE, LOAD_LOADED, Counts
from shardsafe.engine.phases import PhaseLog
from shardsafe.engine.read import (
    Task,
    check_allocation,
    check_sizes,
    chunk_source,
    load_bytes,
    open_manifest,
    plan_reads,
    run_tasks,
)
from shardsafe.errors import CorruptCheckpointError, MissingKeysError, UnforeseenError
from shardsafe.format.manifest import Manifest
from shardsafe.format.resolve import ChunkSource
from shardsafe.progress.record import ProgressCallback
from shardsafe.progress.tracker import Tracker
from shardsafe.state.layout import Box
from shardsafe.state.rest import Remainder, Rest, choose
from shardsafe.state.restore import Op, Restorer
from shardsafe.storage import Storage, get_storage

logger = logging.getLogger(__name__)


def load(
    path: str,
    state: MutableMapping[str, Any] | None,
    *,
    strict: bool,
    clock: Clock,
    group: Any,
    allow_pickle: bool,
    storage_options: dict[str, Any] | None,
    cast: bool = False,
    device: torch.device | None = None,
    progress: ProgressCallback | None = None,
    rest: Rest = "values",
) -> dict[str, Any]:
    """(all ranks of the group, or one process) See :func:`shardsafe.load`. ``rest``: which unrequested
    entries are read and returned (state/rest.py); without a state, every entry."""
    path = str(path)
    storage = get_storage(path, storage_options, deadline=clock.end).within(clock.work)  # every request ends by then
    single = state is None
    op = None if single else Operation.begin("load", path, clock, channel=CHANNEL, group=group)
    started = time.monotonic()
    phases = PhaseLog("load", path, "manifest")
    phase = phases.enter("manifest", None if op is None else op.global_rank)
    tracker = Tracker("load", path, progress)  # progress/tracker.py; phases set below
    tracker.start(op)
    tracker.phase = phase
    error: BaseException | None = None
    nbytes = 0
    try:
        failure: BaseException | None = None
        plan: LoadPlan | None = None
        try:  # every rank plans and validates before the first agreement: a failure here changes nothing
            plan = plan_load(
                path,
                storage,
                state,
                strict=strict,
                cast=cast,
                device=device,
                allow_pickle=allow_pickle,
                rank=None if op is None else op.rank,
                world_size=1 if op is None else op.world_size,
                clock=clock,
                planning=lambda: phases.enter("plan"),
                rest=rest,
            )
            tracker.set_total(load_bytes(plan.manifest, plan.tasks))
        except Exception as err:
            failure = err
        if op is not None:
            failed_in = phases.phase
            phase = tracker.phase = phases.enter("go")
            op.agree(LOAD_ARRIVE, Counts(tracker.own_counts()), failure=failure, failed_in=failed_in)  # the go
        elif failure is not None:
            raise failure
        assert plan is not None
        phase = tracker.phase = phases.enter("read")
        failure = None
        try:  # a failure from here to the next agreement is sent in it: every rank raises
            if op is not None:
                fault_point("load.rendezvous", op.global_rank)
            nbytes = _read_and_restore(path, storage, plan, op, clock, tracker, phases)
        except Exception as err:
            failure = err
        if op is not None:
            failed_in = phases.phase
            phase = tracker.phase = phases.enter("confirm")
            op.agree(
                LOAD_LOADED, Counts(tracker.own_counts()), _final_counts(tracker), failure=failure, failed_in=failed_in
            )
            op.acknowledge()  # rank 0 returns once every live rank knows
        elif failure is not None:
            raise failure
        out: dict[str, Any] = {key: run() for key, run in plan.extra.items()}
        if state is not None:
            out = Remainder(out, path=path, left=plan.left, rest=rest)
            if plan.left:
                logger.debug("shardsafe: load of %s left %s on disk (not asked for; rest=%r)", path, plan.left, rest)
        if plan.restorer.missing:
            logger.warning(
                "shardsafe: loaded %s without %s (not in the checkpoint; strict=False)", path, plan.restorer.missing
            )
    except BaseException as err:
        error = err
        if op is not None and op.outcome_known:
            op.acknowledge()  # the failure is the outcome: rank 0 returns once every live rank knows it
        raise
    finally:
        tracker.end(error)
        if op is not None:
            op.close()
        phases.enter("done")
    took = time.monotonic() - started
    if op is None or op.rank == 0:
        logger.info(
            "shardsafe: loaded %s (%.1f MiB read on rank 0) in %.2fs (%.0f MiB/s)",
            path,
            nbytes / 2**20,
            took,
            nbytes / 2**20 / max(took, 1e-9),
        )
    return out


@dataclass
class LoadPlan:
    """What a rank planned before the go/no-go (:func:`plan_load`): what it reads (``tasks``: a chunk's
    byte range into a destination box each), from which data files (``files``, whose indexes it read
    for a ruled tensor: only those its destinations meet), into which tensors (``restorer``: the
    caller's, filled in place, and new ones), the entries returned unrequested (``extra``) and those
    left on disk (``left``, state/rest.py)."""

    manifest: Manifest
    restorer: Restorer
    tasks: list[Task]
    extra: dict[str, Op]
    left: dict[str, str]
    source: ChunkSource

    @property
    def files(self) -> list[str]:
        """The data files this rank reads from."""
        return sorted({t.chunk.file for t in self.tasks})


def plan_load(
    path: str,
    storage: Storage,
    state: MutableMapping[str, Any] | None,
    *,
    strict: bool,
    cast: bool,
    device: torch.device | None,
    allow_pickle: bool,
    rank: int | None,
    world_size: int,
    clock: Clock,
    planning: Callable[[], object],
    rest: Rest,
) -> LoadPlan:
    """(every rank, locally) Read and validate the manifest, match the state against it, check sizes and
    memory (reading the indexes of the data files this rank's destinations meet, and no other), prepare
    the destinations, run the early reads. Changes nothing of the caller's state. ``rank`` of
    ``world_size`` (``None``: one process loading without a state)."""
    manifest = open_manifest(storage, path)
    planning()
    source = chunk_source(storage, path, manifest)
    r = Restorer(manifest, path, rank=rank, world_size=world_size, cast=cast, device=device, allow_pickle=allow_pickle)
    extra: dict[str, Op] = {}
    left: dict[str, str] = {}
    if state is None:
        extra = {key: r.extra(key) for key in manifest.objects}
    else:
        for key, obj in state.items():
            if key in manifest.objects:
                r.plan_entry(key, obj, state)
            else:
                r.missing.append(key)
        wanted, left = choose(manifest, state, rest)
        extra = {key: r.extra(key) for key in wanted}
        if r.missing and strict:
            raise _missing_error(path, manifest, r.missing)
    regions = r.regions()
    check_sizes(storage, path, manifest, r.names(), source, regions)  # before allocating what the manifest sizes
    if device is None or device.type == "cpu":  # new host tensors must fit in the memory available
        check_allocation(storage, path, manifest, r.fresh_bytes(), source, regions)
    early, tasks = (_reads_of(source, boxes) for boxes in r.prepare())
    if early:  # new tensors whose values the plan must compare before the go (FSDP1 optimizer state)
        run_tasks(storage, path, manifest, early, lambda: None, clock.work)
    r.check()
    return LoadPlan(manifest, r, tasks, extra, left, source)


def _read_and_restore(
    path: str,
    storage: Storage,
    plan: LoadPlan,
    op: Operation | None,
    clock: Clock,
    tracker: Tracker,
    phases: PhaseLog,
) -> int:
    """(every rank, after the go) Read the planned byte ranges, verified, into the destinations; then
    restore modules, optimizers and stateful objects. Returns the bytes read."""
    first = (lambda: fault_point("load.read", op.global_rank)) if op is not None else (lambda: None)
    try:
        nbytes = run_tasks(storage, path, plan.manifest, plan.tasks, first, clock.work, on_bytes=tracker.add)
    except CorruptCheckpointError as err:
        if not plan.restorer.fills_in_place():
            raise
        raise CorruptCheckpointError(
            f"{err} Tensors of the state filled before the damage was found may already hold the "
            "checkpoint's values (no damaged byte was copied; nothing else changed). To change nothing "
            "unless the whole checkpoint verifies, call shardsafe.verify(path) first or use "
            "CheckpointManager.resume(state, verify=True)."
        ) from err
    tracker.phase = phases.enter("restore")
    try:
        plan.restorer.apply()
    except Exception as err:
        raise UnforeseenError(
            f"load of {path!r}: restoring the state failed after the data was read ({type(err).__name__}: "
            f"{err}); the state may be partly loaded. Load again, or resume from another checkpoint."
        ) from err
    return nbytes


def _final_counts(tracker: Tracker) -> Callable[[dict[int, Counts]], Empty]:
    """(rank 0) The ``loaded`` agreement's decision: hand every rank's final counts to the tracker."""

    def decide(counts: dict[int, Counts]) -> Empty:
        tracker.final({r: c.counts for r, c in counts.items()})
        return Empty()

    return decide


def _reads_of(source: ChunkSource, boxes: list[tuple[str, Box]]) -> list[Task]:
    """(every rank, locally) The reads that fill each destination box from the saved chunks it meets."""
    entries = source.manifest.tensors
    return [
        t
        for name, (offsets, dest) in boxes
        for t in plan_reads(
            name, entries[name], dest, offsets, source.chunks(name, (tuple(offsets), tuple(dest.shape)))
        )
    ]


def _missing_error(path: str, manifest: Manifest, missing: list[str]) -> MissingKeysError:
    inner = [m for m in missing if "/" in m]
    hint = f" (a module's missing parameters are listed as <entry>/<name>; {len(inner)} of them)" if inner else ""
    return MissingKeysError(
        f"{path}: the checkpoint lacks {missing}; it holds {sorted(manifest.objects)}{hint}. Nothing was loaded. "
        "Pass strict=False to load what exists (e.g. weights only) and leave the rest untouched.",
        missing=missing,
        available=sorted(manifest.objects),
    )
