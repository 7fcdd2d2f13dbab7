"""The load protocol (DESIGN.md). (all ranks) rendezvous; read and validate the manifest; plan: match
the caller's state with the checkpoint (state/restore.py), checking every key, shape and dtype, the
files' sizes, then allocate what is new; agree go/no-go across ranks; only then read the needed byte
ranges, verified, into the destinations, and restore modules, optimizers and stateful objects through
their own load paths.

All or nothing across ranks: a rank that fails before the go/no-go reports it through the store
(``Coordinator.fail``) and the others' go barrier raises :class:`RemoteRankError`, so a failure found
before reading data (a missing key on one rank, a shape, a dtype, a damaged manifest, a short file)
raises on every rank with every rank's state untouched. A failure while reading (a corrupt block) can
leave tensors read before it loaded; a caller that must not see that verifies first
(``CheckpointManager.resume(state, verify=True)``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import MutableMapping
from typing import Any

import torch

from shardsafe.coord import Coordinator, Deadlines, fault_point
from shardsafe.engine.phases import PhaseLog
from shardsafe.engine.progress import ProgressCallback, load_bytes
from shardsafe.engine.read import Task, check_allocation, check_sizes, plan_reads, read_manifest, run_tasks
from shardsafe.engine.tracker import Tracker
from shardsafe.errors import CheckpointError, CoordinationError, CorruptCheckpointError, MissingKeysError
from shardsafe.format.manifest import Manifest
from shardsafe.state.layout import Box
from shardsafe.state.rest import Remainder, Rest, choose
from shardsafe.state.restore import Op, Restorer
from shardsafe.storage import get_storage

logger = logging.getLogger(__name__)


def load(
    path: str,
    state: MutableMapping[str, Any] | None,
    *,
    strict: bool,
    deadlines: Deadlines,
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
    storage = get_storage(path, storage_options)
    single = state is None
    coord = None if single else Coordinator.join("load", path, deadlines=deadlines, group=group, heartbeat=True)
    started = time.monotonic()
    phases = PhaseLog("load", path, "manifest")
    phase = phases.enter("manifest", None if coord is None else coord.global_rank)
    tracker = Tracker("load", path, progress)  # engine/tracker.py; phases set below
    tracker.start(coord)
    tracker.phase = phase
    error: BaseException | None = None
    try:
        if coord is not None:
            fault_point("load.rendezvous", coord.global_rank)
        manifest = read_manifest(storage, path)
        phase = phases.enter("plan")
        rank, world = (coord.rank, coord.world_size) if coord is not None else (None, 1)
        r = Restorer(manifest, path, rank=rank, world_size=world, cast=cast, device=device, allow_pickle=allow_pickle)
        extra: dict[str, Op] = {}
        left: dict[str, str] = {}  # unrequested entries not read (state/rest.py)
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
        check_sizes(storage, path, manifest, r.names())  # before allocating what the manifest sizes
        if device is None or device.type == "cpu":  # new host tensors must fit in the memory available
            check_allocation(storage, path, manifest, r.fresh_bytes())
        early, tasks = (_plan(manifest, boxes) for boxes in r.prepare())
        if early:  # new tensors whose values the plan must compare before the go (FSDP1 optimizer state)
            run_tasks(storage, path, manifest, early, lambda: None, deadlines.io)
        r.check()
        tracker.set_total(load_bytes(manifest, tasks))
        if coord is not None:
            phase = tracker.phase = phases.enter("go")  # every rank planned and validated: only now may anything change
            coord.barrier("go", timeout=deadlines.io)
        phase = tracker.phase = phases.enter("read")
        first = (lambda: fault_point("load.read", coord.global_rank)) if coord else (lambda: None)
        try:
            nbytes = run_tasks(storage, path, manifest, tasks, first, deadlines.io, on_bytes=tracker.add)
        except CorruptCheckpointError as err:
            if not r.fills_in_place():
                raise
            raise CorruptCheckpointError(
                f"{err} Tensors of the state filled before the damage was found may already hold the "
                "checkpoint's values (no damaged byte was copied; nothing else changed). To change nothing "
                "unless the whole checkpoint verifies, call shardsafe.verify(path) first or use "
                "CheckpointManager.resume(state, verify=True)."
            ) from err
        phase = tracker.phase = phases.enter("restore")
        try:
            r.apply()
        except Exception as err:
            raise CheckpointError(
                f"load of {path!r}: restoring the state failed after the data was read ({type(err).__name__}: "
                f"{err}); the state may be partly loaded. Load again, or resume from another checkpoint."
            ) from err
        out = {key: op() for key, op in extra.items()}
        if state is not None:
            out = Remainder(out, path=path, left=left, rest=rest)
            if left:
                logger.debug("shardsafe: load of %s left %s on disk (not asked for; rest=%r)", path, left, rest)
        if r.missing:
            logger.warning("shardsafe: loaded %s without %s (not in the checkpoint; strict=False)", path, r.missing)
        if coord is not None:
            phase = tracker.phase = phases.enter("confirm")
            tracker.flush()
            coord.barrier("loaded", timeout=deadlines.io)
            coord.acknowledge(timeout=deadlines.arrive)  # rank 0 returns once every live rank knows
    except BaseException as err:
        error = err
        if coord is not None and not isinstance(err, CoordinationError):
            coord.fail(phase, err)
        raise
    finally:
        tracker.end(error)  # before close: rank 0's final record reads this load's keys
        if coord is not None:
            coord.close()
        phases.enter("done")
    took = time.monotonic() - started
    if coord is None or coord.rank == 0:
        logger.info(
            "shardsafe: loaded %s (%.1f MiB read on rank 0) in %.2fs (%.0f MiB/s)",
            path,
            nbytes / 2**20,
            took,
            nbytes / 2**20 / max(took, 1e-9),
        )
    return out


def _plan(manifest: Manifest, boxes: list[tuple[str, Box]]) -> list[Task]:
    """(every rank, locally) The reads that fill each destination box from the saved chunks it meets."""
    return [t for name, (offsets, dest) in boxes for t in plan_reads(name, manifest.tensors[name], dest, offsets)]


def _missing_error(path: str, manifest: Manifest, missing: list[str]) -> MissingKeysError:
    inner = [m for m in missing if "/" in m]
    hint = f" (a module's missing parameters are listed as <entry>/<name>; {len(inner)} of them)" if inner else ""
    return MissingKeysError(
        f"{path}: the checkpoint lacks {missing}; it holds {sorted(manifest.objects)}{hint}. Nothing was loaded. "
        "Pass strict=False to load what exists (e.g. weights only) and leave the rest untouched.",
        missing=missing,
        available=sorted(manifest.objects),
    )
