"""Which checkpoint an incremental save of a :class:`~shardsafe.manager.CheckpointManager` refers to.

(rank 0 only: the save protocol takes rank 0's ``base=`` for every rank.) The newest committed
checkpoint of the manager other than the target, unless a full save is due
(``full_save_every``), or that checkpoint is damaged, refers to the target itself, or lacks a base of
its own: then the save is a full one. A full save is always safe; an incremental one only saves bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence

from shardsafe.engine import api
from shardsafe.errors import CheckpointError
from shardsafe.manager.listing import CheckpointRecord

logger = logging.getLogger(__name__)


def choose_base(
    records: Sequence[CheckpointRecord], target: str, *, since_full: int, every: int, exclude: Collection[str] = ()
) -> str | None:
    """(rank 0) The path of the base for the save to ``target`` (a checkpoint name), or ``None`` for a
    full save. ``records`` come from a scan of the root, oldest first; ``since_full`` counts the
    incremental saves made since the last full one."""
    if since_full + 1 >= every:
        return None
    for record in reversed(records):
        if record.status != "committed" or record.name == target or record.name in exclude:
            continue
        try:
            bases = api.inspect(record.path).bases  # also checks that its own bases are there
        except (CheckpointError, OSError) as err:
            logger.warning("shardsafe: %s cannot serve as a base (%s); this save is a full one", record.path, err)
            return None
        if target in bases:
            return None  # it refers to data in the target, which this save replaces
        return record.path
    return None
