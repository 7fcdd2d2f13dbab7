"""Resuming from the newest checkpoint that is complete and intact, with every rank agreeing on it.

Protocol (every rank calls :func:`resume_newest`):

1. the operation ``manager.resume``; its first agreement, ``plan``: rank 0 lists the root and decides
   the committed checkpoints, newest first, and the entries it skips (incomplete, bad manifest, no
   step, not what the state asks for) with the reason (a listing that fails is decided for every rank:
   each raises the same error);
2. for each candidate: with ``verify``, every rank checks its share of the files and an agreement
   ``verify.<n>`` collects the outcomes (a damaged candidate is skipped before the state changes);
   then every rank loads it with :func:`shardsafe.load` (which verifies every byte it reads), then an
   agreement ``load.<n>`` collects each rank's outcome, so every rank sees the same outcomes and takes
   the same branch:
   - all ranks loaded it: done;
   - any rank found it damaged (corrupt bytes, a missing or truncated file): WARNING naming it and
     why, then the next older candidate, which overwrites whatever the failed attempt loaded;
   - any other failure (keys that do not match the state, a dead rank...): raised on every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, MutableMapping
from dataclasses import dataclass
from typing import Any

from shardsafe.coord import Deadlines, Operation
from shardsafe.coord.messages import Empty
from shardsafe.coord.rounds import Round
from shardsafe.engine import api
from shardsafe.errors import (
    CheckpointError,
    CheckpointTimeoutError,
    CorruptCheckpointError,
    RemoteRankError,
    UnforeseenError,
)
from shardsafe.manager.config import ManagerConfig
from shardsafe.manager.listing import CheckpointRecord, scan
from shardsafe.manager.messages import (
    RESUME_LOAD,
    RESUME_PLAN,
    RESUME_VERIFY,
    Attempt,
    Attempts,
    Candidate,
    ResumePlan,
    Skipped,
    collect,
)
from shardsafe.progress.record import ProgressCallback
from shardsafe.storage import Storage

logger = logging.getLogger(__name__)

# A load failing with one of these means the checkpoint is damaged, not that the state or the job is
# wrong: resuming falls back to the previous checkpoint.
DAMAGED: tuple[type[BaseException], ...] = (CorruptCheckpointError, FileNotFoundError, EOFError)


@dataclass(frozen=True)
class Resumed:
    """What :func:`resume_newest` loaded, and what it found damaged on the way."""

    step: int
    name: str
    damaged: tuple[str, ...]


_NO_STEP = (
    "its manifest records no step and its name tells none, so it cannot be ordered with the others; save it "
    "with metadata={'step': N}, or name it like 'step-N', for resume to use it"
)


def candidates(
    fs: Storage, config: ManagerConfig, asked: Collection[str] | None = None
) -> tuple[list[tuple[CheckpointRecord, bool]], list[Skipped]]:
    """(rank 0, local) What a resume may load, newest first, each with whether the manager named it
    (its ``name`` template made the name), and what it skips with the reason. Every committed
    checkpoint under the root counts, whatever its name, by its step (of the template's name; else
    recorded in its metadata or told by its name, manager/listing.py:step_from_name); on equal steps
    the manager's own name first, then the newer commit. A checkpoint of another name whose step
    cannot be told, or that lacks an entry of ``asked`` (the state's keys), is skipped."""
    records = scan(fs, config.root, config.template, others=True)
    found: list[tuple[CheckpointRecord, bool]] = []
    skipped: list[Skipped] = []
    for r in records:
        if r.status == "retired":
            continue
        if r.status != "committed":
            skipped.append(Skipped(r.name, r.path, r.step, r.reason))
            continue
        own = config.template.parse(r.name) is not None
        why = _NO_STEP if r.step is None else None if own or asked is None else _lacks(r.path, asked)
        if why is not None:
            skipped.append(Skipped(r.name, r.path, r.step, why))
            continue
        found.append((r, own))
    found.sort(key=lambda c: (c[0].step or 0, c[1], c[0].created or 0.0, c[0].name), reverse=True)
    return found, skipped


def _lacks(path: str, asked: Collection[str]) -> str | None:
    """Why a checkpoint the manager did not name is not loaded into a state with keys ``asked``: it lacks
    some of them (a weights-only export beside the run's checkpoints, say), or its manifest went bad."""
    try:
        held = {e.name for e in api.inspect(path).entries if e.kind != "tensor"}
    except CheckpointError as err:
        return f"{type(err).__name__}: {err}"
    lacking = sorted(set(asked) - held)
    if not lacking:
        return None
    return (
        f"it does not hold {lacking}, which the state asks for (it holds {sorted(held)}); a checkpoint this "
        "manager did not name is used only when it holds every entry of the state"
    )


def _candidates_plan(fs: Storage, config: ManagerConfig, asked: Collection[str]) -> ResumePlan:
    found, skipped = candidates(fs, config, asked)
    return ResumePlan([Candidate(r.name, r.path, r.step or 0, own) for r, own in found], skipped)


def _outcome(err: Exception | None) -> Attempt:
    if err is None:
        return Attempt(True, False, "")
    return Attempt(False, isinstance(err, DAMAGED), f"{type(err).__name__}: {err}")


def resume_newest(
    fs: Storage,
    config: ManagerConfig,
    state: MutableMapping[str, Any],
    *,
    rank: int,
    deadlines: Deadlines,
    verify: bool = False,
    progress: ProgressCallback | None = None,
) -> Resumed | None:
    """(every rank) Load the newest loadable checkpoint under ``config.root`` into ``state``.

    With ``verify``, every byte of a candidate is checked first (rank ``r`` of ``n`` checks every n-th
    data file, all ranks the manifest) and the ranks agree on the outcome before anything is loaded:
    a damaged candidate is skipped with ``state`` untouched. Without it, damage found while reading
    can leave part of a skipped candidate in ``state`` (overwritten by the next candidate that loads).

    Returns ``None`` when there is no committed checkpoint. Raises :class:`CorruptCheckpointError`
    when there are some but every one is damaged (``state`` may then hold part of one of them, unless
    ``verify``), and re-raises on every rank a failure that is not about the checkpoint's bytes; a
    listing that fails on rank 0 raises the same :class:`CheckpointError` on every rank. ``progress``
    is passed to each :func:`shardsafe.load` (rank 0 calls it)."""
    op = Operation.begin("manager.resume", config.root, deadlines.start())  # one deadline for the whole resume
    return op.conclude(lambda: _resume(op, fs, config, state, deadlines, verify, progress))


def _resume(
    op: Operation,
    fs: Storage,
    config: ManagerConfig,
    state: MutableMapping[str, Any],
    deadlines: Deadlines,
    verify: bool,
    progress: ProgressCallback | None,
) -> Resumed | None:
    def listing(_arrivals: dict[int, Empty]) -> ResumePlan:
        try:
            return _candidates_plan(fs, config, list(state))
        except CheckpointError:
            raise
        except Exception as err:  # decided for every rank: each raises this same error
            raise UnforeseenError(
                f"resume from {config.root!r}: listing its checkpoints failed on rank 0 ({type(err).__name__}: "
                f"{err}); fix the storage or the path and restart"
            ) from err

    plan = op.agree(RESUME_PLAN, Empty(), listing)
    damaged: list[str] = []
    failures: list[str] = []
    for n, candidate in enumerate(plan.candidates):
        name, path, step, own = candidate.name, candidate.path, candidate.step, candidate.own
        steps: list[tuple[Round[Attempt, Attempts], Callable[[], Any]]] = []
        if verify:

            def check(path: str = path) -> None:
                api.verify(path, part=(op.rank, op.world_size), timeout=_left(op, path, "verifying"))

            steps.append((RESUME_VERIFY, check))

        def load(path: str = path) -> None:  # rest="none": nothing is returned, so nothing unrequested is read
            api.load(path, state, timeout=_left(op, path, "loading"), progress=progress, rest="none")

        steps.append((RESUME_LOAD, load))
        why = None
        for rnd, run in steps:
            why = _attempt(op, rnd.nth(n), rnd.phase, run, path, deadlines)
            if why is not None:
                break
        if why is None:
            _warn_skipped(op.rank, plan.skipped, step)
            if op.rank == 0:
                other = "" if own else f"; not named by name={config.name!r}, so retention never deletes it"
                logger.info("shardsafe: resumed from %s (step %d%s)", path, step, other)
            return Resumed(step=step, name=name, damaged=tuple(damaged))
        if op.rank == 0:
            logger.warning("shardsafe: resume skips %s (step %d): damaged: %s", path, step, why)
        damaged.append(name)
        failures.append(f"  {path}: {why}")
    _warn_skipped(op.rank, plan.skipped, None)
    if failures:
        untouched = (
            "The state is untouched (every candidate failed verification)."
            if verify
            else ("The state may hold part of one of them.")
        )
        raise CorruptCheckpointError(
            f"no checkpoint under {config.root!r} could be loaded; every committed one is damaged:\n"
            + "\n".join(failures)
            + f"\n{untouched} Repair or move these away to start from scratch."
        )
    if op.rank == 0:
        logger.info("shardsafe: no committed checkpoint under %s; starting from scratch", config.root)
    return None


def _left(op: Operation, path: str, what: str) -> Deadlines:
    """(every rank, before a step of a resume on ``path``) What is left of the resume's one deadline, as
    the budget of that step's own call. Raises :class:`CheckpointTimeoutError` (not damage: shared and
    raised on every rank) when nothing is left."""
    left = op.clock.end.remaining()
    if left <= 0:
        raise CheckpointTimeoutError(
            f"resume: its deadline ({op.clock.end.seconds:.0f}s, the manager's timeout=) passed before {what} "
            f"{path!r}; raise timeout= or move the damaged checkpoints away"
        )
    return Deadlines(arrive=min(op.clock.budget.arrive, left), io=left)


def _attempt(
    op: Operation, rnd: Round[Attempt, Attempts], what: str, run: Callable[[], Any], path: str, deadlines: Deadlines
) -> str | None:
    """(every rank) Run one step on a candidate and share its outcome, so every rank takes the same
    branch: ``None`` when it succeeded on every rank, the reasons when some rank found the checkpoint
    damaged; any other failure is raised on every rank. The agreement waits until the end of the
    operation's one deadline at most, or ``deadlines.io`` if that is sooner."""
    error: Exception | None = None
    try:
        run()
    except Exception as err:  # classified and shared below; re-raised unless it means "damaged"
        error = err
    mine = _outcome(error)
    outcomes = op.agree(rnd, mine, collect, deadline=op.clock.end.within(deadlines.io, "io")).attempts
    if all(o.ok for o in outcomes):
        return None
    why = "; ".join(f"rank {r}: {o.error}" for r, o in enumerate(outcomes) if not o.ok)
    if not any(o.damaged for o in outcomes):
        if error is not None:
            raise error
        r, o = next((r, o) for r, o in enumerate(outcomes) if not o.ok)
        raise RemoteRankError(
            f"resume from {path!r} failed on rank {r} ({what}): {o.error}. This is not damage to the checkpoint "
            "(so no older one is tried); fix the cause on that rank and restart.",
            rank=r,
            phase=f"manager.resume.{what}",
            cause=o.error,
        ) from None
    return why


def _warn_skipped(rank: int, skipped: list[Skipped], chosen_step: int | None) -> None:
    """(rank 0 logs) The incomplete or unreadable entries newer than the one resumed from."""
    if rank != 0:
        return
    for s in skipped:
        if chosen_step is None or s.step is None or s.step > chosen_step:
            logger.warning("shardsafe: resume skips %s (step %s): %s", s.path, s.step, s.reason)


def newest_verified(fs: Storage, config: ManagerConfig) -> CheckpointRecord | None:
    """(any rank, local) The newest committed checkpoint that passes :func:`shardsafe.verify`, among
    those a resume may load (:func:`candidates`, whatever their names), skipping damaged ones with a
    WARNING. Reads every byte of each candidate it checks."""
    for record, _ in candidates(fs, config)[0]:
        try:
            api.verify(record.path)
        except (CorruptCheckpointError, OSError, EOFError) as err:
            logger.warning(
                "shardsafe: %s is damaged (%s: %s); trying an older one", record.path, type(err).__name__, err
            )
            continue
        return record
    return None
