"""Progress counts through the rendezvous store: each rank of a save or load posts its own byte counts
under the operation's keys, and rank 0 reads every rank's. Never a collective of the training group.

Keys, under the operation's prefix (see :mod:`shardsafe.coord.group`)::

    <seq>/progress/r/<rank>    {"d": done bytes, "t": total bytes, "p": phase} of that rank

They are registered as the operation's ``progress`` phase, so rank 0 deletes them with the operation's
other keys once every rank has left it. Every call here is a single non-blocking store request
(``set``, ``check``, or a ``get``/``multi_get`` of keys known to exist), bounded by the store's own
timeout. They run on the progress thread, so a slow store never holds up a writer or reader; the one
exception is each rank's last ``set`` before the operation's last barrier, made on the operation's
thread like the protocol's own requests (the barrier right after meets the same store).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardsafe.coord import Coordinator

PHASE = "progress"


@dataclass(frozen=True)
class RankCounts:
    """One rank's progress as it last posted it."""

    done: int
    total: int
    phase: str

    def to_json(self) -> str:
        return json.dumps({"d": self.done, "t": self.total, "p": self.phase})

    @staticmethod
    def from_json(raw: str | bytes) -> RankCounts | None:
        """The counts in ``raw``, or ``None`` when it is not a well-formed record (a rank's own key:
        nothing else writes there, but a reader never trusts a store value's shape)."""
        try:
            doc = json.loads(raw)
            done, total, phase = doc["d"], doc["t"], doc["p"]
        except (ValueError, KeyError, TypeError):
            return None
        if type(done) is not int or type(total) is not int or not isinstance(phase, str):
            return None
        if done < 0 or total < 0:
            return None
        return RankCounts(done, total, phase)


def shared(coord: Coordinator | None) -> bool:
    """Whether the operation of ``coord`` has other ranks to share progress with through a store."""
    return coord is not None and coord.store is not None and coord.world_size > 1 and coord.seq > 0


def register(coord: Coordinator) -> None:
    """(every rank, the operation's thread, after joining) Record the progress keys as used by this
    operation, so rank 0's cleanup of finished operations deletes them."""
    coord._use(PHASE)


def _key(coord: Coordinator, rank: int) -> str:
    return coord._k(PHASE, "r", str(rank))


def publish(coord: Coordinator, counts: RankCounts) -> None:
    """(any rank, any thread) Post this rank's counts (one ``set``; raises what the store raises)."""
    assert coord.store is not None
    coord.store.set(_key(coord, coord.rank), counts.to_json())


def gather(coord: Coordinator) -> dict[int, RankCounts]:
    """(rank 0, any thread) The counts every other rank has posted so far (ranks that have posted
    nothing yet are absent). One ``multi_get`` when every rank has posted, else a ``check`` and a
    ``get`` per rank that has. Raises what the store raises."""
    store = coord.store
    assert store is not None
    ranks = [r for r in range(coord.world_size) if r != coord.rank]
    keys = [_key(coord, r) for r in ranks]
    if not keys:
        return {}
    raw: list[bytes | None]
    if store.check(keys):
        raw = list(store.multi_get(keys))
    else:
        raw = [store.get(k) if store.check([k]) else None for k in keys]
    out: dict[int, RankCounts] = {}
    for r, value in zip(ranks, raw, strict=True):
        counts = RankCounts.from_json(value) if value is not None else None
        if counts is not None:
            out[r] = counts
    return out
