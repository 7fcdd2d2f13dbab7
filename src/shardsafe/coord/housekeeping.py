"""Key housekeeping: the per-process sequence numbers that match operations across ranks, and rank 0's
deletion of the keys of operations every rank has left, so a long run leaves nothing behind."""

from __future__ import annotations

import logging
import threading

from shardsafe.coord.access import StoreAccess, _phases_used

logger = logging.getLogger(__name__)

_seq_lock = threading.Lock()
_seq: dict[tuple[int, str], int] = {}
_cleaned: dict[tuple[int, str], int] = {}


class Housekeeping(StoreAccess):
    """The key cleanup of a :class:`~shardsafe.coord.Coordinator`."""

    def _cleanup_previous(self, key: tuple[int, str]) -> None:
        """Rank 0 deletes the keys of earlier operations of this channel that every rank has left:
        those every rank reported done (:meth:`close`), or, for operations without a heartbeat, all
        before this one (every rank reached this one). It stops at the first one still running (an
        async save in flight), so cleanup never removes keys a background phase still waits on."""
        if self.rank != 0:
            return
        with _seq_lock:
            start = _cleaned.get(key, 0) + 1
        done_upto = start - 1
        for seq in range(start, self.seq):
            prefix = f"{self.prefix}/{seq}"
            phases = _phases_used.get((key, seq), {"arrive"})
            if "hb" in phases and self._add(f"{prefix}/done", 0) < self.world_size:
                break
            names = [f"{prefix}/abort", f"{prefix}/done", f"{prefix}/decision"]
            names += [f"{prefix}/{w}/{r}" for w in ("hb", "ack") for r in range(self.world_size)]
            for phase in phases - {"hb", "ack"}:
                names += [f"{prefix}/{phase}"]  # a posted value
                names += [f"{prefix}/{phase}/{leaf}" for leaf in ("count", "decision", "value")]
                names += [f"{prefix}/{phase}/r/{r}" for r in range(self.world_size)]
            for name in names:
                try:
                    self._store().delete_key(name)
                except Exception as err:  # housekeeping only: a key of a finished operation is inert
                    logger.debug("shardsafe: could not delete store key %s: %s", name, err)
            _phases_used.pop((key, seq), None)
            done_upto = seq
        with _seq_lock:
            _cleaned[key] = done_upto
