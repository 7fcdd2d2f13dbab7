"""Per-step agreements outside any operation: rank 0's decision for a step (:class:`StepBroadcast`, a
declared :class:`~shardsafe.coord.rounds.Broadcast`) and a step every rank settles on, the first
proposal winning (:class:`StopAgreement`). The checkpoint manager is their user (its schedule and its
preemption step); this module knows none of its words.

A broadcast is the one form of round in which only rank 0's input counts, so nobody else sends a
message: rank 0 posts its typed :class:`~shardsafe.coord.messages.Decision` under
``<group namespace>/<owner>/<n>/<name>/<step>``, each other rank waits for it (one blocking ``get``)
and counts itself in (``add``); the last reader deletes both keys, so nothing accumulates over a long
run. Being per step, they stay out of the operations' sequence numbers, and rank 0 never waits for
the others. Every request goes through the process's :class:`~shardsafe.coord.client.StoreClient`,
bounded by the owner's ``timeout``.

``<n>`` is the owner's creation index in this process: every rank creates its owners (managers) in the
same order, so the n-th of each rank uses the same keys.
"""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING

from shardsafe.coord.client import StoreClient, client_for
from shardsafe.coord.messages import Decision
from shardsafe.coord.rounds import Broadcast
from shardsafe.deadline import Deadline
from shardsafe.errors import RankTimeoutError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

logger = logging.getLogger(__name__)

_instances = itertools.count()


class StoreKeys:
    """One owner's keys, and the client its requests go through."""

    def __init__(self, client: StoreClient, prefix: str, timeout: float) -> None:
        self.client = client
        self.prefix = prefix
        self.timeout = timeout

    @classmethod
    def for_owner(
        cls, store: Store | None, namespace: str, identity: int, timeout: float, owner: str
    ) -> StoreKeys | None:
        """The keys of a newly created ``owner`` (``"manager"``); ``None`` with no store (one process)."""
        index = next(_instances)
        if store is None:
            return None
        return cls(client_for(store, identity), f"{namespace}/{owner}/{index}", timeout)

    def key(self, *parts: str) -> str:
        return "/".join((self.prefix, *parts))

    def deadline(self) -> Deadline:
        return Deadline.after(self.timeout, "step")


class StepBroadcast:
    """(every rank) Rank 0's decision for a step in the broadcast ``rnd``, shared with the others; see
    the module docstring."""

    def __init__(self, keys: StoreKeys | None, rnd: Broadcast, *, rank: int, world_size: int) -> None:
        self.keys = keys
        self.rnd = rnd
        self.name = rnd.name
        self.rank = rank
        self.world_size = world_size

    def share(self, step: int, value: str | None) -> str:
        """Rank 0 passes ``value`` and gets it back; the others pass ``None`` and get rank 0's."""
        if self.keys is None or self.world_size == 1:
            assert value is not None
            return value
        keys = self.keys
        key = keys.key(self.name, str(step))
        deadline = keys.deadline()
        with keys.client.session():  # its lanes end with this call
            if self.rank == 0:
                assert value is not None
                keys.client.set(key, Decision(value).to_text(), deadline)
                return value
            return self._read(keys, key, step, deadline)

    def _read(self, keys: StoreKeys, key: str, step: int, deadline: Deadline) -> str:
        raw = keys.client.wait_value(key, deadline)
        if raw is None:
            raise RankTimeoutError(
                f"{self.rnd.what}({step}) on rank {self.rank}: rank 0 gave no {self.name} decision for step {step} "
                f"within {keys.timeout:.0f}s. {self.rnd.hint}",
                missing_ranks=[0],
            )
        got = Decision.from_text(raw).value
        if keys.client.add(f"{key}/read", 1, deadline) == self.world_size - 1:
            keys.client.delete(key, deadline)
            keys.client.delete(f"{key}/read", deadline)
        return got


class StopAgreement:
    """(every rank) The step at which all ranks take the preemption checkpoint, agreed through the
    store under ``<manager keys>/stop_at`` (the first proposal wins). With no store (one process) the
    agreement is local."""

    def __init__(self, keys: StoreKeys | None) -> None:
        self.keys = keys
        self._local: int | None = None

    def propose(self, step: int) -> int:
        """Ask to stop at ``step`` unless a step is already agreed; return the agreed step."""
        if self.keys is None:
            if self._local is None:
                self._local = step
            return self._local
        keys = self.keys
        with keys.client.session():  # its lanes end with this call
            self._local = int(keys.client.compare_set(keys.key("stop_at"), str(step), keys.deadline()))
        return self._local

    def agreed(self) -> int | None:
        """The agreed step, or ``None`` when no rank has asked to stop (one ``check`` on the store
        until a step is known, none after)."""
        keys = self.keys
        if self._local is None and keys is not None:
            with keys.client.session():  # its lanes end with this call
                if keys.client.check([keys.key("stop_at")], keys.deadline()):
                    self._local = int(keys.client.get(keys.key("stop_at"), keys.deadline()))
        return self._local
