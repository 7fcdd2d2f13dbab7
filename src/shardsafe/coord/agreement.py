"""The manager's own keys in the rendezvous store, for the agreements it makes every step: rank 0's
per-step decisions (:class:`StepBroadcast`) and the preemption step (:class:`StopAgreement`).

These are raw store keys under ``<group namespace>/manager/<n>/`` rather than a
:class:`~shardsafe.coord.Coordinator` operation, because they run every step: a rendezvous costs
arrival records, a counter, a decision and a read of every rank's record, while a per-step decision
here costs one ``set`` on rank 0 and a ``check``/``get``/``add`` on the others, and a preemption check
one ``check``. They stay out of the coordinator's operation sequence altogether.

``<n>`` is the manager's creation index in this process: every rank creates its managers in the
same order, so the n-th manager of each rank uses the same keys.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from shardsafe.coord.access import guarded
from shardsafe.coord.waiting import wait_until
from shardsafe.errors import RankDeadError, RankTimeoutError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

logger = logging.getLogger(__name__)

_instances = itertools.count()


class StoreKeys:
    """Store access under one prefix; a lost store raises :class:`RankDeadError` with the fix."""

    def __init__(self, store: Store, prefix: str) -> None:
        self.store = store
        self.prefix = prefix

    @classmethod
    def for_manager(cls, store: Store | None, namespace: str) -> StoreKeys | None:
        """The keys of a newly created manager; ``None`` with no store (one process)."""
        index = next(_instances)
        return None if store is None else cls(store, f"{namespace}/manager/{index}")

    def key(self, *parts: str) -> str:
        return "/".join((self.prefix, *parts))

    def set(self, key: str, value: str) -> None:
        self._call("set", key, lambda: self.store.set(key, value))

    def get(self, key: str) -> str:
        raw: bytes = self._call("get", key, lambda: self.store.get(key))
        return raw.decode()

    def check(self, key: str) -> bool:
        return bool(self._call("check", key, lambda: self.store.check([key])))

    def add(self, key: str, n: int) -> int:
        return int(self._call("add", key, lambda: self.store.add(key, n)))

    def delete(self, key: str) -> None:
        self._call("delete", key, lambda: self.store.delete_key(key))

    def compare_set(self, key: str, value: str) -> str:
        """Set ``key`` to ``value`` unless it is set already; return the value it holds now."""
        raw: bytes = self._call("compare_set", key, lambda: self.store.compare_set(key, "", value))
        return raw.decode()

    def _call(self, what: str, key: str, fn: Callable[[], Any]) -> Any:
        return guarded(
            fn,
            lambda err: RankDeadError(
                f"CheckpointManager: lost the rendezvous store during {what} of {key!r} ({err}). The process "
                "hosting it (rank 0 or the launcher) has most likely died; restart the job, it resumes from the "
                "last committed checkpoint."
            ),
        )


class StepBroadcast:
    """(every rank) Rank 0's decision for a step, shared with the others.

    Rank 0 sets ``<prefix>/<name>/<step>``; each other rank waits for it (up to ``timeout``), reads
    it and counts itself in ``.../read``; the last reader deletes both keys, so nothing accumulates
    over a long run."""

    def __init__(self, keys: StoreKeys | None, name: str, *, rank: int, world_size: int, timeout: float) -> None:
        self.keys = keys
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout

    def share(self, step: int, value: str | None) -> str:
        """Rank 0 passes ``value`` and gets it back; the others pass ``None`` and get rank 0's."""
        if self.keys is None or self.world_size == 1:
            assert value is not None
            return value
        key = self.keys.key(self.name, str(step))
        if self.rank == 0:
            assert value is not None
            self.keys.set(key, value)
            return value
        self._await(key, step)
        got = self.keys.get(key)
        if self.keys.add(f"{key}/read", 1) == self.world_size - 1:
            self.keys.delete(key)
            self.keys.delete(f"{key}/read")
        return got

    def _await(self, key: str, step: int) -> None:
        keys = self.keys
        assert keys is not None  # share() checked it

        def stalled(elapsed: float) -> None:
            logger.warning(
                "shardsafe: rank %d has waited %.1fs of %.0fs for rank 0's %s decision of step %d",
                self.rank,
                elapsed,
                self.timeout,
                self.name,
                step,
            )

        if not wait_until(lambda: keys.check(key), timeout=self.timeout, stalled=stalled):
            raise RankTimeoutError(
                f"CheckpointManager.should_save({step}) on rank {self.rank}: rank 0 gave no {self.name} "
                f"decision for step {step} within {self.timeout:.0f}s. Every rank must call should_save / "
                "maybe_save with the same steps in the same order; if rank 0 is merely slow, raise timeout=.",
                missing_ranks=[0],
            )


class StopAgreement:
    """(every rank) The step at which all ranks take the preemption checkpoint, agreed through the
    store under ``<manager keys>/stop_at``. With no store (one process) the agreement is local."""

    def __init__(self, keys: StoreKeys | None) -> None:
        self.keys = keys
        self._local: int | None = None

    def propose(self, step: int) -> int:
        """Ask to stop at ``step`` unless a step is already agreed; return the agreed step."""
        if self.keys is None:
            if self._local is None:
                self._local = step
            return self._local
        self._local = int(self.keys.compare_set(self.keys.key("stop_at"), str(step)))
        return self._local

    def agreed(self) -> int | None:
        """The agreed step, or ``None`` when no rank has asked to stop (one ``check`` on the store
        until a step is known, none after)."""
        if self._local is None and self.keys is not None and self.keys.check(self.keys.key("stop_at")):
            self._local = int(self.keys.get(self.keys.key("stop_at")))
        return self._local
