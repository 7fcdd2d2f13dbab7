"""``shardsafe.delete``: remove one checkpoint the catalog's way (:mod:`shardsafe.catalog.delete`), the
piece a framework's rotation calls (Lightning's ``remove_checkpoint``, a trainer's "keep the last N").

One process, no rendezvous: it is not a collective. A job calls it on one rank (rank 0 after the save
that made the checkpoint redundant, as :mod:`shardsafe.lightning` does); processes that delete the same
path at once converge (every step is idempotent: whoever finds the manifest already set aside as the
tombstone finishes the deletion from it), and once the checkpoint is gone a later call raises
:class:`CheckpointNotFoundError`.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from shardsafe.catalog.delete import delete_checkpoint, finish_deletion, remove_link
from shardsafe.catalog.names import TOMBSTONE, link_target
from shardsafe.catalog.not_found import describe
from shardsafe.deadline import Deadlines
from shardsafe.engine.guard import entry_point
from shardsafe.errors import CheckpointNotFoundError, InvalidArgumentError
from shardsafe.storage import MANIFEST_NAME, Storage, get_storage
from shardsafe.workers import run_bounded

logger = logging.getLogger(__name__)

__all__ = ["delete"]


@entry_point("delete", reads=False)
def delete(
    path: str | os.PathLike[str],
    *,
    timeout: float | Deadlines | None = None,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """Delete the committed checkpoint at ``path`` (one process; see the module docstring).

    The catalog's delete rule: the manifest is validated, then set aside as a tombstone (from that
    instant the checkpoint is no longer committed, never half-committed), then the data files it lists
    go (not those an incremental sibling refers to), then the tombstone, then the empty folder. A crash
    leaves the committed checkpoint or an uncommitted one with its tombstone, which the next
    ``delete(path)`` or a :class:`CheckpointManager` finishes. Anything else in the folder stays.

    A folder holding only a tombstone (a deletion that was interrupted) is finished. When ``path`` (a
    local path or ``file://`` URL) is a symbolic link, the link itself is removed and what it leads to
    is left alone; only a link to a shardsafe checkpoint, or to nothing, is removed.

    Refused with nothing touched: a path that holds no checkpoint (:class:`CheckpointNotFoundError`
    saying what is there: nothing, a file, another kind of folder, an uncommitted save), a manifest that
    does not validate (:class:`CorruptCheckpointError`), a link to something else
    (:class:`InvalidArgumentError`). ``timeout``: seconds the whole deletion may take (default
    ``SHARDSAFE_IO_TIMEOUT``); past it :class:`CheckpointTimeoutError` (the deletion goes on, or resumes
    at the next call). ``storage_options``: fsspec options for URLs, ignored for local paths.
    """
    path = os.fspath(path)
    deadline = Deadlines.resolve(timeout).start().end
    storage = get_storage(path, storage_options, deadline=deadline)  # every request bounded by it
    if link_target(path) is not None:
        try:
            target = run_bounded("removing the link", path, deadline, lambda: remove_link(path))
        except ValueError as err:
            raise InvalidArgumentError(str(err)) from None
        logger.info("shardsafe: removed the link %s (to %s); the checkpoint it leads to stays", path, target)
        return
    removed = run_bounded("deleting the checkpoint", path, deadline, lambda: _delete(storage, path))
    logger.info("shardsafe: deleted the checkpoint %s (%d data files)", path, removed)


def _delete(storage: Storage, path: str) -> int:
    """(on a worker thread, under the call's deadline) The deletion; the number of data files removed
    by this call. Another caller deleting the same checkpoint at once makes a step find its file gone:
    the deletion goes on from what is left (the tombstone), and is done once neither is there."""
    manifest, tomb = storage.join(path, MANIFEST_NAME), storage.join(path, TOMBSTONE)
    if not (storage.exists(manifest) or storage.exists(tomb)):
        if storage.exists(path) and not storage.is_dir(path):
            raise CheckpointNotFoundError(
                f"refusing to delete {path}: it is a file, not a shardsafe checkpoint (a folder with MANIFEST.json); "
                "shardsafe deletes only the checkpoints it wrote. Remove it yourself if it should go."
            )
        raise CheckpointNotFoundError(f"refusing to delete {path}: {describe(storage, path).message}")
    for _ in range(3):
        try:
            if storage.exists(manifest):
                return len(delete_checkpoint(storage, path))
            return len(finish_deletion(storage, path))
        except FileNotFoundError:
            if not (storage.exists(manifest) or storage.exists(tomb)):
                return 0  # another caller finished it
    return len(finish_deletion(storage, path))
