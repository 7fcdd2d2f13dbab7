"""Per-rank counters of one operation: each rank posts its own record (a short text), rank 0 reads every
rank's. Progress reporting (:mod:`shardsafe.progress`) is their user; never a collective of the
training group.

Keys, under the operation's prefix (:mod:`shardsafe.coord.session`)::

    <seq>/counters/<name>/<rank>    that rank's last record

They are recorded as used by the operation, so rank 0 deletes them with its other keys. Posting is not
waited for; rank 0's read is one ``check`` and one ``multi_get`` (per-rank ``check``/``get`` only while
some rank has posted nothing yet), bounded by ``SHARDSAFE_DEAD_AFTER``. Neither counts in the
operation's tally: they run on the progress thread, not on the protocol's path."""

from __future__ import annotations

from shardsafe import knobs
from shardsafe.coord.session import Session
from shardsafe.deadline import Deadline


class Counters:
    """(every rank of an operation with peers) The counters called ``name``; see the module docstring."""

    def __init__(self, s: Session, name: str) -> None:
        self.s = s
        self.under = f"counters/{name}"
        s.use(self.under, tuple(str(r) for r in range(s.world_size)))

    def _key(self, rank: int) -> str:
        return self.s.key(self.under, str(rank))

    @staticmethod
    def _bound() -> Deadline:
        return Deadline.after(knobs.dead_after(), "progress")

    def post(self, record: str) -> None:
        """(this rank, any thread) Post this rank's record (not waited for)."""
        assert self.s.client is not None
        self.s.client.set(self._key(self.s.rank), record, self._bound())

    def gather(self) -> dict[int, str]:
        """(rank 0, any thread) The records every other rank has posted so far (ranks that have posted
        nothing yet are absent). Raises what the store raises."""
        s = self.s
        client = s.client
        assert client is not None
        ranks = [r for r in range(s.world_size) if r != s.rank]
        keys = [self._key(r) for r in ranks]
        if not keys:
            return {}
        bound = self._bound()
        raw: list[str | None]
        if client.check(keys, bound):
            raw = list(client.multi_get(keys, bound))
        else:
            raw = [client.get(k, bound) if client.check([k], bound) else None for k in keys]
        return {r: value for r, value in zip(ranks, raw, strict=True) if value is not None}
