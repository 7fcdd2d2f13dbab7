"""The :class:`CheckpointManager`: when to save, what to keep, where to resume from, and a clean stop
on preemption. It composes the pieces of this package; each rule lives in its own module."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import torch

from shardsafe import knobs
from shardsafe.coord import Deadlines
from shardsafe.coord.resolve import resolve_group
from shardsafe.coord.steps import StepBroadcast, StopAgreement, StoreKeys
from shardsafe.engine import api
from shardsafe.engine.guard import entry_point, mapped_errors
from shardsafe.engine.options import SaveOptions
from shardsafe.errors import CheckpointError, ClosedError, InvalidArgumentError
from shardsafe.manager.chain import COUNT, Known, choose_base
from shardsafe.manager.cleanup import apply_retention, remove_leftovers
from shardsafe.manager.config import ManagerConfig
from shardsafe.manager.listing import CheckpointRecord, scan
from shardsafe.manager.local import LocalTierRuntime, within_work
from shardsafe.manager.preemption import SignalFlag
from shardsafe.manager.resume import newest_verified, resume_newest
from shardsafe.manager.retention import RetentionPolicy
from shardsafe.manager.schedule import PREEMPTION, TICK, Schedule
from shardsafe.manager.tiers import LocalTier
from shardsafe.progress.record import ProgressCallback, check_callback
from shardsafe.storage import get_storage

logger = logging.getLogger(__name__)

State = Mapping[str, Any]
Metrics = Mapping[str, Any] | None
Callback = ProgressCallback | None


@dataclass
class _Pending:
    """An async save in flight."""

    handle: api.SaveHandle
    step: int
    name: str
    housekept: bool = False


class CheckpointManager:
    """Saves a training run's checkpoints under ``root`` on a schedule, keeps the ones retention asks
    for, resumes from the newest one that is complete and intact, and takes a last checkpoint when the
    job is preempted (a signal in ``save_on_signals``).

    Create it on every rank after ``torch.distributed.init_process_group`` (or with no process group
    for one process), with the same arguments, and call the same methods with the same steps on every
    rank; the manager makes the ranks agree (through the rendezvous store) and rank 0 alone deletes.

    Typical loop::

        with CheckpointManager("run/", every_n_steps=500, keep_last=3) as mgr:
            start = mgr.resume(state) or 0
            for step in range(start + 1, total + 1):
                train_step()
                mgr.maybe_save(step, state, metrics={"loss": loss})
                if mgr.should_stop():
                    break

    Arguments are those of :class:`~shardsafe.manager.ManagerConfig`, which checks them, and
    ``progress``: the callback (e.g. :class:`shardsafe.ProgressBar`) of every save and resume the
    manager makes, including the ones it triggers itself (scheduled and preemption saves); rank 0 calls
    it with :class:`shardsafe.Progress` records (docs/progress.md). ``progress=`` on a call replaces it
    for that call. A callback that is not callable raises ``TypeError`` here. ``local``: a
    :class:`~shardsafe.LocalTier` (docs/tiers.md): frequent saves to each node's own folder, replicated
    to a peer node, which :meth:`resume` prefers when newer than the durable store's newest.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        every_n_steps: int | None = None,
        every_seconds: float | None = None,
        keep_last: int | None = 3,
        keep_best: int = 0,
        monitor: str | None = None,
        mode: Literal["min", "max"] = "min",
        keep_every_n_steps: int | None = None,
        name: str = "step-{step:08d}",
        async_save: bool = False,
        staging: Literal["blocking", "background"] = "blocking",
        save_on_signals: tuple[int, ...] = (signal.SIGTERM,),
        timeout: float | None = None,
        leftover_age: float = 3600.0,
        verify_on_resume: bool = False,
        incremental: bool = False,
        full_save_every: int | None = None,
        progress: ProgressCallback | None = None,
        local: LocalTier | None = None,
    ) -> None:
        self.config = ManagerConfig(
            root=os.fspath(root),
            every_n_steps=every_n_steps,
            every_seconds=every_seconds,
            keep_last=keep_last,
            keep_best=keep_best,
            monitor=monitor,
            mode=mode,
            keep_every_n_steps=keep_every_n_steps,
            name=name,
            async_save=async_save,
            staging=staging,
            save_on_signals=save_on_signals,
            timeout=timeout,
            leftover_age=leftover_age,
            verify_on_resume=verify_on_resume,
            incremental=incremental,
            full_save_every=full_save_every,
        )
        self._fs = get_storage(self.config.root)
        self._storage = get_storage(self.config.root)  # deletes go through shardsafe.catalog.delete
        store, self.rank, self.world_size, _, namespace, identity = resolve_group(None)
        self._deadlines = Deadlines.resolve(self.config.timeout)
        self._policy = RetentionPolicy(
            keep_last=self.config.keep_last,
            keep_best=self.config.keep_best,
            monitor=self.config.monitor,
            mode=self.config.mode,
            keep_every_n_steps=self.config.keep_every_n_steps,
        )
        keys = StoreKeys.for_owner(store, namespace, identity, self._deadlines.arrive, "manager")
        self._flag = SignalFlag(self.config.save_on_signals)
        self._schedule = Schedule(
            self.config,
            rank=self.rank,
            flag=self._flag,
            stop=StopAgreement(keys),
            tick=StepBroadcast(keys, TICK, rank=self.rank, world_size=self.world_size),
        )
        self._pending: _Pending | None = None
        self._resumed_step: int | None = None
        self._damaged: set[str] = set()
        self._closed = False
        self._progress = check_callback(progress)
        self._durable: int | None = None
        self._links: Known = {}  # manifests of the incremental chain already read (rank 0; a cache only)
        if local is not None and not isinstance(local, LocalTier):
            raise InvalidArgumentError(f"local={local!r} must be a shardsafe.LocalTier")
        self._local = (
            None
            if local is None
            else LocalTierRuntime(local, self.rank, self.world_size, self.config.timeout, self._fs, self.config.root)
        )

    def __repr__(self) -> str:
        return f"CheckpointManager({self.config.root!r}, rank={self.rank}/{self.world_size})"

    # ---------------------------------------------------------------------------------- saving

    @entry_point("CheckpointManager.should_save", reads=False)
    def should_save(self, step: int) -> bool:
        """(every rank, same steps) Whether ``step`` is to be saved: a preemption stop is due, or
        ``step % every_n_steps == 0``, or ``every_seconds`` have passed on rank 0's clock. The answer
        is the same on every rank; for the time-based check the other ranks wait for rank 0's decision
        (deadline: ``timeout``)."""
        self._check_open()
        return self._schedule.reason(_check_step(step)) is not None

    @entry_point("CheckpointManager.save", reads=False)
    def maybe_save(self, step: int, state: State, metrics: Metrics = None, *, progress: Callback = None) -> bool:
        """(every rank) With a local tier, a local save first when ``step`` is a multiple of its
        ``every_n_steps``; then :meth:`save` when :meth:`should_save`. Returns whether it saved (to
        either tier). A local save that failed on some rank (a full disk, a peer it could not replicate
        to) is reported, with a WARNING naming the rank, its node and folder, and costs nothing else: the
        durable save due at the same step goes on, and so does training. Failures to agree (a rank dead,
        a deadline) raise as they do from :meth:`save_local`."""
        self._check_open()
        self._callback(progress)
        self._poll_pending()
        local = self._local is not None and _check_step(step) % self._local.tier.every_n_steps == 0
        durable = self.should_save(step)
        if local and self._local is not None:
            if not self._local.recorded:
                self._finish_pending()  # rank 0 records the run with a save of its own: none may be in flight
            failure = self._local.save(step, state, self._durable_step, self._deadlines.start())
            if failure is not None:
                local = False
                if self.rank == 0 or failure.own is not None:
                    logger.warning(
                        "shardsafe: local-tier save of step %d failed on %s. %s; fix the cause on that node (a full "
                        "disk: free space in its folder, or give LocalTier a folder on a larger disk); the local "
                        "tier's earlier steps are intact",
                        step,
                        failure.message,
                        "The durable save of this step goes on" if durable else "No durable save is due at this step",
                    )
        if not durable:
            return local
        self.save(step, state, metrics, progress=progress)
        return True

    @entry_point("CheckpointManager.save_local", reads=False)
    def save_local(self, step: int, state: State) -> None:
        """(every rank) Save ``state`` as ``step`` in the node-local tier (``local=``): each rank's share
        to its node's folder, replicated to its peers; returns once every rank's share and replicas are
        in place (else raises on every rank). Then each rank applies the tier's retention."""
        self._check_open()
        if self._local is None:
            raise InvalidArgumentError(f"{self!r} has no local tier; pass local=shardsafe.LocalTier(...)")
        step = _check_step(step)
        if not self._local.recorded:
            self._finish_pending()  # rank 0 records the run with a save of its own: none may be in flight
        failure = self._local.save(step, state, self._durable_step, self._deadlines.start())  # the call's one
        if failure is not None:
            raise failure.error(step)

    @entry_point("CheckpointManager.save", reads=False)
    def save(self, step: int, state: State, metrics: Metrics = None, *, progress: Callback = None) -> None:
        """(every rank) Save ``state`` as the checkpoint of ``step`` (replacing one of that step
        atomically), with ``metadata={"step": step, "metrics": metrics}`` (and, with ``incremental``,
        ``saves_since_full``: whether the next save is full is read back from it after a restart).

        Waits first for an async save still in flight. Synchronous: returns once committed on every
        rank, after rank 0 applied retention. Async: returns once the state is staged; retention runs
        after the commit. A preemption save is always flushed before returning, after which
        :meth:`should_stop` is True. ``progress``: the callback of this save (rank 0 calls it, as
        :func:`shardsafe.save` does; for an async save, also after this returns); default: the
        manager's ``progress``."""
        self._check_open()
        callback = self._callback(progress)
        step = _check_step(step)
        clean = _check_metrics(metrics)
        if self.config.monitor is not None and self.config.monitor not in clean and self.rank == 0:
            logger.warning(
                "shardsafe: step %d saved without metrics[%r]; it cannot count among keep_best",
                step,
                self.config.monitor,
            )
        reason = self._schedule.pending_reason(step)
        self._finish_pending()
        name = self.config.template.format(step)
        path = self._fs.join(self.config.root, name)
        metadata: dict[str, Any] = {"step": step, "metrics": clean}
        if self.rank == 0:
            logger.debug("shardsafe: manager saves step %d to %s (trigger: %s)", step, path, reason or "save()")
        self._schedule.started()
        base = self._base(name, metadata) if self.config.incremental and self.rank == 0 else None
        options: SaveOptions = {
            "overwrite": True,
            "timeout": self.config.timeout,
            "metadata": metadata,
            "base": base,
            "progress": callback,
            "staging": self.config.staging,
        }
        if self.config.async_save:
            handle = api.async_save(path, state, **options)
            self._pending = _Pending(handle, step, name)
            if reason == PREEMPTION:
                self._finish_pending()
        else:
            api.save(path, state, **options)
            self._after_commit(name)
        self._schedule.saved(step)

    @entry_point("CheckpointManager.wait", reads=False)
    def wait(self) -> None:
        """(every rank) Wait for the async save in flight, if any, and raise its error if it failed
        (on every rank: the save protocol gives every rank the failure). Then rank 0 applies
        retention. Bounded by the save's own deadlines."""
        self._finish_pending()

    def should_stop(self) -> bool:
        """True once the checkpoint asked for by a preemption signal is committed (on every rank at
        the same step): the loop should end now."""
        return self._schedule.stopped

    # ------------------------------------------------------------------------------- resuming

    @entry_point("CheckpointManager.resume", reads=True)
    def resume(
        self,
        state: MutableMapping[str, Any],
        *,
        verify: bool | None = None,
        progress: Callback = None,
    ) -> int | None:
        """(every rank) Load the newest checkpoint that is complete and intact into ``state`` and return
        its step; ``None`` when there is none. Incomplete or damaged newer ones are skipped with a
        WARNING naming them and why; that checkpoint is never deleted by retention until a newer one
        is committed. With ``verify`` (default: ``verify_on_resume``) every byte of a checkpoint is
        checked before it is loaded, so ``state`` changes only from one that verified whole. Every
        failure is a :class:`CheckpointError` (anything unforeseen is mapped to one, its cause chained).
        ``progress`` (default: the manager's): the callback of each load it tries (rank 0 calls it, as
        :func:`shardsafe.load` does), one series of records per checkpoint, each ending in a final
        record (``error`` set for a damaged one it skips)."""
        self._check_open()
        callback = self._callback(progress)
        self._finish_pending()  # a save in flight ends (or raises) before loading into the state
        check = self.config.verify_on_resume if verify is None else verify
        clock = self._deadlines.start()  # with a local tier: the one deadline of its every step
        with mapped_errors("resume", self.config.root):
            durable = self._newest_durable()
            if self._local is not None:
                step = self._local.resume(state, durable, clock)
                if step is not None:
                    self._local.begin(step, clock)
                    self._resumed_step = step
                    self._schedule.saved(step)
                    return step
            result = resume_newest(
                self._fs,
                self.config,
                state,
                rank=self.rank,
                deadlines=self._deadlines if self._local is None else within_work(clock),
                verify=check,
                progress=callback,
            )
        if self._local is not None:
            self._local.begin(None if result is None else result.step, clock)
        if result is None:
            return None
        self._resumed_step = result.step
        self._damaged.update(result.damaged)
        self._schedule.saved(result.step)
        return result.step

    @entry_point("CheckpointManager.list", reads=True)
    def list(self) -> list[CheckpointRecord]:
        """(any rank, local) The committed checkpoints of this manager (names made by ``name``), oldest
        first, with step, commit time, size and metrics. Reads only manifests."""
        return [r for r in scan(self._fs, self.config.root, self.config.template) if r.status == "committed"]

    @entry_point("CheckpointManager.latest", reads=True)
    def latest(self) -> CheckpointRecord | None:
        """(any rank, local) The newest committed checkpoint that passes :func:`shardsafe.verify`
        (damaged ones are skipped with a WARNING); reads every byte of each one it checks."""
        return newest_verified(self._fs, self.config)

    # -------------------------------------------------------------------------------- closing

    @entry_point("CheckpointManager.close", reads=False)
    def close(self) -> None:
        """(every rank) Flush the async save in flight (raising its error), then put back the signal
        handlers that were there before. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._finish_pending()
        finally:
            self._flag.restore()
            if self._local is not None:
                self._local.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ------------------------------------------------------------------------------- internals

    def _callback(self, progress: Callback) -> Callback:
        """The ``progress=`` of a call (checked), else the manager's."""
        return self._progress if check_callback(progress) is None else progress

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{self!r} is closed; create a new CheckpointManager to save or resume again")

    def _base(self, name: str, metadata: dict[str, Any]) -> Callable[[], str | None]:
        """(rank 0; the save takes rank 0's base for every rank) What chooses the base of an incremental
        save to ``name`` (``None``: a full save) when the save starts, inside it, so that a failure to
        read the root fails the save on every rank instead of leaving the others waiting for rank 0;
        it records in ``metadata`` how many incremental saves this one makes since the last full one
        (read back from storage by the next save, whatever process makes it: manager/chain.py)."""

        def choose() -> str | None:
            every = self.config.full_save_every or knobs.full_save_every()
            records = scan(self._fs, self.config.root, self.config.template)
            base, metadata[COUNT] = choose_base(
                self._fs, records, name, every=every, exclude=self._damaged, known=self._links
            )
            logger.debug("shardsafe: manager saves %s %s", name, f"incrementally on {base}" if base else "in full")
            return base

        return choose

    @property
    def _durable_step(self) -> int | None:
        """The newest step this process saw committed to the durable store (saved or resumed)."""
        return self._durable

    def _newest_durable(self) -> int | None:
        """(rank 0: its answer decides for every rank, in the local tier's resume agreement) The newest
        committed durable step of this manager's names; ``None`` on other ranks and without a local tier."""
        if self.rank != 0 or self._local is None:
            return None
        records = scan(self._fs, self.config.root, self.config.template)
        steps = [r.step for r in records if r.status == "committed" and r.step is not None]
        self._durable = max(steps) if steps else None
        return self._durable

    def _poll_pending(self) -> None:
        """(rank 0) Apply retention as soon as an async save has committed, without waiting for it.
        A failed one is left for :meth:`_finish_pending`, which raises it on every rank at the same
        call."""
        p = self._pending
        if self.rank != 0 or p is None or p.housekept or not p.handle.done() or p.handle.exception() is not None:
            return
        p.housekept = True
        self._after_commit(p.name)

    def _finish_pending(self) -> None:
        p, self._pending = self._pending, None
        if p is None:
            return
        p.handle.wait()
        if not p.housekept:
            self._after_commit(p.name)

    def _after_commit(self, name: str) -> None:
        """(every rank; rank 0 acts) ``name`` has committed: apply retention and remove leftovers of
        crashed saves. Failures are logged, never raised: the checkpoint itself is safe."""
        self._damaged.discard(name)
        parsed = self.config.template.parse(name)
        if parsed is not None:
            self._durable = parsed if self._durable is None else max(self._durable, parsed)
        if self.rank != 0:
            return
        try:
            records = scan(self._fs, self.config.root, self.config.template)
            protect: set[int] = set()
            resumed = self._resumed_step
            if resumed is not None and not any(
                r.status == "committed" and r.step is not None and r.step > resumed and r.name not in self._damaged
                for r in records
            ):
                protect.add(resumed)
            apply_retention(self._storage, records, self._policy, protect=protect, exclude=self._damaged)
            busy = {self._pending.name} if self._pending is not None else set()
            remove_leftovers(self._fs, self._storage, records, min_age=self.config.leftover_age, busy=busy)
        except (OSError, CheckpointError) as err:  # retention is not the save: its failure is reported, not raised
            logger.error(
                "shardsafe: housekeeping of %s after committing %s failed: %s. The checkpoint is safe; old "
                "ones were not deleted this time.",
                self.config.root,
                name,
                err,
            )


def _check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InvalidArgumentError(f"step={step!r} must be an integer >= 0 (the training step)")
    return step


def _check_metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    if metrics is None:
        metrics = {}
    if not isinstance(metrics, Mapping):
        raise InvalidArgumentError(f"metrics={metrics!r} must be a dict of name -> number, e.g. {{'loss': 0.3}}")
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise InvalidArgumentError(f"metrics key {key!r} must be a str")
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise InvalidArgumentError(
                    f"metrics[{key!r}] is a tensor of shape {tuple(value.shape)}; pass one number"
                )
            value = value.item()
        if value is not None and not isinstance(value, (int, float, str)):
            raise InvalidArgumentError(
                f"metrics[{key!r}]={value!r} ({type(value).__name__}) must be a number, str, bool or None"
            )
        out[key] = value
    return out
