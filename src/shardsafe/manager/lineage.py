"""Which run, and which incarnation of it, a local-tier copy belongs to (docs/tiers.md, "Runs, saves and
incarnations").

**The run** is the durable root: its first local save records a run id there, in ``<root>/.shardsafe-run``
(a one-process shardsafe checkpoint, committed like any other; a hidden name, so the manager's listing,
retention and cleanup never see it). A requeue of the same run (the same root) finds the same id and
resumes its local shares; a new run (a new or emptied root) records a new one, and the shares of any
other run, in the same node folders, never count and are never deleted.

**An incarnation** is one job of the run, from its resume on: it records, in the same place, the step it
resumed from (``-1``: none), at the end of its resume, else once its first local save completed on every
rank; its shares count only from then on, so a job that dies before it saved anything abandons nothing.
A share of incarnation *j* at step *s* is on the run's line of history only when every later incarnation
resumed from *s* or later: a later one that resumed from an older step abandoned it, whether or not its
copies could be deleted then (a node folder that job did not see, a file it could not remove). So a step
is resumed only from a save of an incarnation whose history the run kept, never from one another job
moved past.

Every record is written by rank 0 (inside an agreement, so every rank learns its outcome), with
``overwrite=True``: the record stays whole and committed at every instant."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from shardsafe.coord.resolve import SOLO
from shardsafe.engine import api
from shardsafe.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, LocalTierError
from shardsafe.manager.tiers import RUN_ID
from shardsafe.storage import Storage

logger = logging.getLogger(__name__)

RECORD = ".shardsafe-run"
"""The run record's name in the durable root."""


@dataclass(frozen=True)
class RunRecord:
    """A run's id and its incarnations in order, each with the step it resumed from (``-1``: none)."""

    run: str
    incarnations: tuple[tuple[str, int], ...]

    def counts(self, incarnation: str, step: int) -> bool:
        """Whether a share that incarnation ``incarnation`` saved at ``step`` is on the run's line of
        history: the incarnation is recorded, and every later one resumed from ``step`` or later."""
        ids = [i for i, _ in self.incarnations]
        if incarnation not in ids:
            return False
        return all(start >= step for _, start in self.incarnations[ids.index(incarnation) + 1 :])

    def adding(self, incarnation: str, start: int) -> RunRecord:
        """This record with ``incarnation`` (resumed from ``start``) as the newest."""
        kept = tuple(i for i in self.incarnations if i[0] != incarnation)
        if start < 0:  # it resumed from nothing: every earlier share is abandoned, their entries say nothing
            kept = ()
        return RunRecord(self.run, (*kept, (incarnation, start)))

    def to_metadata(self) -> dict[str, Any]:
        return {"local_tier_run": self.run, "incarnations": [[i, s] for i, s in self.incarnations]}

    @staticmethod
    def from_metadata(meta: Any, where: str) -> RunRecord:
        bad = CorruptCheckpointError(
            f"{where} is not a local-tier run record ({meta!r:.200}); move it away (the local tier then records a "
            "new run, and the local copies of the old one are left alone)"
        )
        if not isinstance(meta, dict) or not isinstance(meta.get("local_tier_run"), str):
            raise bad
        run, found = meta["local_tier_run"], meta.get("incarnations")
        if not RUN_ID.match(run) or not isinstance(found, list):
            raise bad
        out: list[tuple[str, int]] = []
        for item in found:
            if not (
                isinstance(item, list)
                and len(item) == 2
                and isinstance(item[0], str)
                and RUN_ID.match(item[0])
                and isinstance(item[1], int)
                and not isinstance(item[1], bool)
                and item[1] >= -1
            ):
                raise bad
            out.append((item[0], item[1]))
        return RunRecord(run, tuple(out))


def record_path(fs: Storage, root: str) -> str:
    return fs.join(root, RECORD)


def read_record(fs: Storage, root: str) -> RunRecord | None:
    """(rank 0) The run record of the durable root ``root``; ``None`` when there is none (no local save
    yet). Raises :class:`CorruptCheckpointError` for one that does not validate."""
    path = record_path(fs, root)
    try:
        meta = api.inspect(path).metadata
    except CheckpointNotFoundError:
        return None
    return RunRecord.from_metadata(meta, path)


def write_record(fs: Storage, root: str, record: RunRecord, timeout: float | None) -> None:
    """(rank 0) Commit ``record`` as the run record of ``root`` (replacing the old one atomically)."""
    path = record_path(fs, root)
    try:
        api.save(path, {"run": record.run}, group=SOLO, overwrite=True, timeout=timeout, metadata=record.to_metadata())
    except CheckpointError as err:
        raise LocalTierError(
            f"recording the local tier's run in {path} failed ({type(err).__name__}: {err}); the durable store must "
            "be writable for the local tier to know whose its copies are"
        ) from err
