"""Progress counts shared between the ranks of a save or load: each rank posts its own byte counts
and rank 0 reads every rank's, through the operation's per-rank counters
(:meth:`Operation.counters <shardsafe.coord.operation.Operation.counters>`, called ``progress``): the
store is :mod:`shardsafe.coord`'s business, never a collective of the training group.

A rank's record is ``{"d": done bytes, "t": total bytes, "p": phase}``. Posts are not waited for, and
rank 0's read is one ``check`` and one ``multi_get``. They run on the progress thread, so a slow store
never holds up a writer, a reader or a wait of the protocol. A rank's final counts ride on its last
message of the operation (the write report of a save, the last agreement of a load), so the end costs
no request of its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardsafe.coord.counters import Counters
    from shardsafe.coord.operation import Operation

NAME = "progress"


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


def shared(op: Operation | None) -> Counters | None:
    """The progress counters of ``op``, when it has other ranks to share progress with."""
    return None if op is None else op.counters(NAME)


def publish(counters: Counters, counts: RankCounts) -> None:
    """(any rank, any thread) Post this rank's counts (not waited for)."""
    counters.post(counts.to_json())


def gather(counters: Counters) -> dict[int, RankCounts]:
    """(rank 0, any thread) The counts every other rank has posted so far (ranks that have posted
    nothing yet, or something malformed, are absent). Raises what the store raises."""
    out: dict[int, RankCounts] = {}
    for r, value in counters.gather().items():
        counts = RankCounts.from_json(value)
        if counts is not None:
            out[r] = counts
    return out
