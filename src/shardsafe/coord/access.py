"""Store access for one coordinated operation: the key layout, every store call (a lost store
becomes :class:`RankDeadError`), and the status lines, stall warnings and timeout errors that say
where each rank is. The base of :class:`~shardsafe.coord.Coordinator`."""

from __future__ import annotations

import json
import logging
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch._C._distributed_c10d import Store

from shardsafe.errors import RankDeadError, RankTimeoutError

if TYPE_CHECKING:
    from shardsafe.coord.deadlines import Deadlines

logger = logging.getLogger(__name__)

# Phases each operation used, per (group identity, channel prefix) and sequence number: rank 0's
# cleanup deletes exactly those keys.
_phases_used: dict[tuple[tuple[int, str], int], set[str]] = {}


def guarded(fn: Callable[[], Any], lost: Callable[[BaseException], RankDeadError]) -> Any:
    """Run one store call. The store client raises ``RuntimeError`` or ``OSError`` when the store is
    gone (its host died): that becomes ``lost(err)``, raised from the original."""
    try:
        return fn()
    except (RuntimeError, OSError) as err:
        raise lost(err) from err


class StoreAccess:
    """The store side of a :class:`~shardsafe.coord.Coordinator` (which sets these attributes)."""

    store: Store | None
    rank: int
    world_size: int
    global_rank: int
    namespace: str
    prefix: str
    op: str
    target: str
    deadlines: Deadlines
    seq: int
    identity: int

    def _k(self, *parts: str) -> str:
        return "/".join((self.prefix, str(self.seq), *parts))

    def _get_all(self, phase: str) -> list[str]:
        return [self._get(self._k(phase, "r", str(r))) for r in range(self.world_size)]

    def _timeout_error(self, phase: str, missing: list[int], timeout: float, by: int | None = None) -> RankTimeoutError:
        picture = "\n".join(self._status_lines())
        if by is not None and by != self.rank and self.rank in missing:
            head = (
                f"{self.op} of {self.target!r}: rank {by} gave up waiting for this rank (rank {self.rank}) in phase "
                f"{phase!r} after {timeout:.0f}s; this rank came too late. Raise timeout= (or SHARDSAFE_TIMEOUT / "
                "SHARDSAFE_IO_TIMEOUT) if it is merely slow."
            )
        elif phase == "arrive":
            head = (
                f"{self.op} of {self.target!r}: rank {self.rank} waited {timeout:.0f}s for every rank to arrive, but "
                f"ranks {missing} never arrived. Call {self.op}() on every rank of the process group, with the same "
                f"path; the library decides who reads and writes what. (If those ranks are merely slow, raise "
                "timeout= or SHARDSAFE_TIMEOUT.)"
            )
        else:
            head = (
                f"{self.op} of {self.target!r}: rank {self.rank} waited {timeout:.0f}s in phase {phase!r}, but ranks "
                f"{missing} did not get there (slow storage, or a hang or crash on those ranks). If they are merely "
                "slow, raise timeout= or SHARDSAFE_IO_TIMEOUT."
            )
        return RankTimeoutError(f"{head} Where each rank was:\n{picture}", missing_ranks=missing)

    def _warn_stall(self, phase: str, what: str, missing: list[int], elapsed: float, timeout: float) -> None:
        stack = "".join(traceback.format_stack(limit=12)[:-2])
        logger.warning(
            "shardsafe: rank %d has waited %.1fs of %.0fs for %s (%s of %s, phase %s); not there yet: %s\n"
            "ranks:\n%s\nwaiting at:\n%s",
            self.rank,
            elapsed,
            timeout,
            what,
            self.op,
            self.target,
            phase,
            missing,
            "\n".join(self._status_lines()),
            stack,
        )

    def _status(self, phase: str) -> None:
        if self.store is None:
            return
        record = {"op": self.op, "target": self.target, "seq": self.seq, "phase": phase, "since": time.time()}
        self._set(f"{self.namespace}/status/{self.rank}", json.dumps(record))

    def _status_lines(self) -> list[str]:
        lines = []
        now = time.time()
        for r in range(self.world_size):
            key = f"{self.namespace}/status/{r}"
            try:
                if not self._check(key):
                    lines.append(f"  rank {r}: no shardsafe call seen yet")
                    continue
                s = json.loads(self._get(key))
            except RankDeadError:
                lines.append(f"  rank {r}: unknown (store unreachable)")
                continue
            lines.append(
                f"  rank {r}: {s['op']}({s['target']!r}) #{s['seq']} in phase {s['phase']!r} "
                f"for {now - s['since']:.1f}s"
            )
        return lines

    def _use(self, phase: str) -> None:
        if self.rank == 0:
            _phases_used.setdefault(((self.identity, self.prefix), self.seq), set()).add(phase)

    # Store access: every call goes through _call, which turns a lost connection into RankDeadError.

    def _store(self) -> Store:
        assert self.store is not None
        return self.store

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        return guarded(
            fn,
            lambda err: RankDeadError(
                f"{self.op} of {self.target!r}: rank {self.rank} lost the rendezvous store during {what} "
                f"({err}). The process hosting it (rank 0 or the launcher) has most likely died; restart "
                "the job, it will resume from the last committed checkpoint.",
                store_lost=True,
            ),
        )

    def _set(self, k: str, v: str) -> None:
        self._call(f"set {k}", lambda: self._store().set(k, v))

    def _get(self, k: str) -> str:
        raw: bytes = self._call(f"get {k}", lambda: self._store().get(k))
        return raw.decode()

    def _check(self, k: str) -> bool:
        return bool(self._call(f"check {k}", lambda: self._store().check([k])))

    def _add(self, k: str, n: int) -> int:
        return int(self._call(f"add {k}", lambda: self._store().add(k, n)))

    def _compare_set(self, k: str, v: str) -> str:
        """Set ``k`` to ``v`` unless it is already set; return whichever value it holds now."""
        raw: bytes = self._call(f"compare_set {k}", lambda: self._store().compare_set(k, "", v))
        return raw.decode()
