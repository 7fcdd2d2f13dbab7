"""Error propagation: the abort record with which a failing rank tells every other rank of the
operation, and the error each of them raises from it (:class:`RemoteRankError`, or
:class:`RankDeadError` for a rank whose heartbeat stopped)."""

from __future__ import annotations

import json
import logging
from typing import Any

from shardsafe.coord.access import StoreAccess
from shardsafe.errors import CoordinationError, RankDeadError, RemoteRankError

logger = logging.getLogger(__name__)


class Failures(StoreAccess):
    """The abort record of a :class:`~shardsafe.coord.Coordinator`."""

    def fail(self, phase: str, err: BaseException, *, rank: int | None = None) -> None:
        """(the failing rank) Tell every rank of this operation that it failed, so their waits raise
        :class:`RemoteRankError` at once instead of at the deadline. The caller re-raises ``err``.
        ``rank``: the rank to blame when it is not this one (a rank found dead)."""
        if self.store is None or self.world_size == 1 or self.seq == 0:
            return
        who = self.global_rank if rank is None else rank
        record = {"rank": who, "phase": phase, "error": f"{type(err).__name__}: {err}"}
        try:
            self._compare_set(self._k("abort"), json.dumps(record))
        except RankDeadError as dead:
            # The store is gone, so nobody can be told; the caller raises its own error anyway.
            logger.error("shardsafe: rank %d could not report its failure in %s: %s", self.rank, phase, dead)

    def remote_failure(self) -> CoordinationError | None:
        """The error another rank recorded for this operation, if one did (as this rank would raise
        it); ``None`` when no rank failed, or this rank was the first."""
        if self.store is None or self.world_size == 1 or self.seq == 0:
            return None
        key = self._k("abort")
        if not self._check(key):
            return None
        record = json.loads(self._get(key))
        if record["rank"] == self.global_rank:
            return None
        return self.error_from(record)

    def error_from(self, record: dict[str, Any]) -> CoordinationError:
        """The error this rank raises for an abort ``record`` (``rank``, ``phase``, ``error``): the one
        :meth:`fail` wrote, or the one a decision settled on."""
        if str(record["error"]).startswith("RankDeadError"):
            return RankDeadError(
                f"{self.op} of {self.target!r}: rank {record['rank']} died in phase {record['phase']!r} (its heartbeat "
                "stopped). Nothing was committed; restart the job, it resumes from the last committed checkpoint."
            )
        cause = str(record["error"]).rstrip(".")
        return RemoteRankError(
            f"{self.op} of {self.target!r} failed on rank {record['rank']} in phase {record['phase']!r}: "
            f"{cause}. Nothing was committed by this {self.op}; fix the cause on rank {record['rank']} and retry.",
            rank=record["rank"],
            phase=record["phase"],
            cause=record["error"],
        )

    def _raise_if_aborted(self) -> None:
        failure = self.remote_failure()
        if failure is not None:
            raise failure
