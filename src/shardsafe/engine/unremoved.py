"""Failed saves of this process whose files could not be removed: a filesystem remounted read-only
(or one that refuses with ``EACCES``/``EPERM``, or a full or failing disk) refuses the removal of the
pending directory and of the data files moved into the target as it refused the commit.

They are surely no longer in flight (their save raised), so the next save of this process that
commits beside them (same parent folder, hence the same storage) removes them at once through
:func:`shardsafe.catalog.delete.discard_save`, without waiting for the leftover age that the rule for
other processes' leftovers (:mod:`shardsafe.catalog.orphans`) needs. Remembered by rank 0 only (the
rank that sweeps after a commit), at most :data:`LIMIT` of them; what a process does not live to
remove, a later save or a manager's cleanup removes once older than the leftover age.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from shardsafe.catalog.refs import split

LIMIT = 64


@dataclass(frozen=True)
class Unremoved:
    """What :func:`shardsafe.catalog.delete.discard_save` needs to remove a failed save's files."""

    path: str
    pending: str
    save_id: str
    world_size: int


_lock = threading.Lock()
_left: dict[tuple[str, str], Unremoved] = {}


def remember(left: Unremoved) -> None:
    """(rank 0, its save failed and the removal of its files failed too) Keep ``left`` for the next
    save beside it; the oldest is dropped beyond :data:`LIMIT`."""
    with _lock:
        _left[(left.pending, left.save_id)] = left
        while len(_left) > LIMIT:
            del _left[next(iter(_left))]


def beside(path: str) -> list[Unremoved]:
    """(rank 0, a save of ``path`` committed) The remembered saves whose target shares ``path``'s
    parent folder."""
    parent = split(path)[0]
    with _lock:
        return [left for left in _left.values() if split(left.path)[0] == parent]


def forget(left: Unremoved) -> None:
    """``left``'s files are gone."""
    with _lock:
        _left.pop((left.pending, left.save_id), None)


def forget_all() -> None:
    """Forget every remembered save (a test standing for a new process)."""
    with _lock:
        _left.clear()
