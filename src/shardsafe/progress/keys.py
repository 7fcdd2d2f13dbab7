"""Progress counts through the rendezvous store: each rank of a save or load posts its own byte counts
under the operation's keys, and rank 0 reads every rank's. Never a collective of the training group.

Keys, under the operation's prefix (see :mod:`shardsafe.coord.operation`)::

    <seq>/progress/r/<rank>    {"d": done bytes, "t": total bytes, "p": phase} of that rank

They are recorded as the operation's ``progress`` phase, so rank 0 deletes them with the operation's
other keys. Every call here goes through the process's store client, bounded: posts are not waited
for, and rank 0's read is one ``check`` and one ``multi_get`` (per-rank ``get``\\ s only while some rank
has posted nothing yet). They run on the progress thread, so a slow store never holds up a writer, a
reader or a wait of the protocol. A rank's final counts ride on its last message of the operation
(the write report of a save, the last agreement of a load), so the end costs no request of its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardsafe import knobs
from shardsafe.deadline import Deadline

if TYPE_CHECKING:
    from shardsafe.coord.operation import Operation

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


def shared(op: Operation | None) -> bool:
    """Whether ``op`` has other ranks to share progress with through a store."""
    return op is not None and not op.single


def register(op: Operation) -> None:
    """(every rank, the operation's thread, after it began) Record the progress keys as used by this
    operation, so rank 0 deletes them with the others."""
    op.used.add(PHASE)


def _key(op: Operation, rank: int) -> str:
    return op.key(PHASE, "r", str(rank))


def _bound() -> Deadline:
    return Deadline.after(knobs.dead_after(), "progress")


def publish(op: Operation, counts: RankCounts) -> None:
    """(any rank, any thread) Post this rank's counts (not waited for)."""
    assert op.client is not None
    op.client.set(_key(op, op.rank), counts.to_json(), _bound())


def gather(op: Operation) -> dict[int, RankCounts]:
    """(rank 0, any thread) The counts every other rank has posted so far (ranks that have posted
    nothing yet are absent). Raises what the store raises."""
    client = op.client
    assert client is not None
    ranks = [r for r in range(op.world_size) if r != op.rank]
    keys = [_key(op, r) for r in ranks]
    if not keys:
        return {}
    bound = _bound()
    raw: list[str | None]
    if client.check(keys, bound):
        raw = list(client.multi_get(keys, bound))
    else:
        raw = [client.get(k, bound) if client.check([k], bound) else None for k in keys]
    out: dict[int, RankCounts] = {}
    for r, value in zip(ranks, raw, strict=True):
        counts = RankCounts.from_json(value) if value is not None else None
        if counts is not None:
            out[r] = counts
    return out
