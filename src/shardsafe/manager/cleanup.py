"""Deleting checkpoints that retention lets go, and the leftovers of crashed saves.

Called by rank 0 only, after a new checkpoint has committed. Every removal goes through
:mod:`shardsafe.catalog.delete`: only names shardsafe writes, taken from a validated manifest (a
checkpoint, a tombstone) or from a pending directory's own save id; folders only once empty, never
recursively. A checkpoint is uncommitted first (its manifest renamed to a tombstone), so a
half-deleted one is never taken for committed. One failed delete is logged and the rest go on: a
full or flaky disk must not turn a successful save into a crash.

An entry of the root that is a symbolic link (to a checkpoint elsewhere) is never deleted, retired
or cleaned up: nothing is removed through it, and the link itself stays (shardsafe did not write
it), with a WARNING each time retention would have deleted it. Remove such a link by hand.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from shardsafe.catalog import unlink
from shardsafe.catalog.delete import delete_checkpoint as _delete_checkpoint
from shardsafe.catalog.delete import delete_files, finish_deletion, remove_pending
from shardsafe.catalog.names import PENDING_DIR, TOMBSTONE, link_target
from shardsafe.catalog.orphans import StorageClock, is_abandoned, orphaned_files
from shardsafe.catalog.refs import split
from shardsafe.errors import CorruptCheckpointError
from shardsafe.manager.listing import CheckpointRecord
from shardsafe.manager.retention import RetentionPolicy
from shardsafe.storage.base import Storage

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Candidate:
    step: int
    metrics: Mapping[str, Any]
    record: CheckpointRecord


def delete_checkpoint(storage: Storage, record: CheckpointRecord) -> None:
    """Remove one committed checkpoint: its manifest becomes the tombstone (from then on it is no
    longer committed, whatever happens next), then its data files, the tombstone and the folder go.
    Raises ``OSError`` on failure, :class:`CorruptCheckpointError` (deleting nothing) when its
    manifest does not validate."""
    _delete_checkpoint(storage, record.path)


def apply_retention(
    storage: Storage,
    records: Sequence[CheckpointRecord],
    policy: RetentionPolicy,
    *,
    protect: Collection[int] = (),
    exclude: Collection[str] = (),
) -> list[str]:
    """(rank 0) Delete the committed checkpoints ``policy`` does not keep; return their names.

    ``protect``: steps never deleted now (the checkpoint the run resumed from, until a newer one
    exists). ``exclude``: names left out of the decision altogether (checkpoints known to be corrupt:
    they count toward no limit, and stay on disk for inspection until a save overwrites them)."""
    committed = [
        _Candidate(r.step, r.metrics, r)
        for r in records
        if r.status == "committed" and r.step is not None and r.name not in exclude
    ]
    deleted = []
    for candidate in policy.to_delete(committed, protect=protect):
        record = candidate.record
        target = link_target(record.path)
        if target is not None:
            logger.warning(
                "shardsafe: not deleting old checkpoint %s (retention): it is a symbolic link to %s, and shardsafe "
                "deletes nothing through a link (that checkpoint is not this run's to delete). Remove the link by "
                "hand to silence this.",
                record.path,
                target,
            )
            continue
        try:
            delete_checkpoint(storage, record)
        except (OSError, CorruptCheckpointError, ValueError) as err:
            logger.error(
                "shardsafe: could not delete old checkpoint %s (retention): %s. It stays on disk; the next "
                "save tries again. Check the permissions and health of %s.",
                record.path,
                err,
                record.path,
            )
            continue
        logger.info("shardsafe: deleted old checkpoint %s (step %s, retention)", record.path, record.step)
        deleted.append(record.name)
    return deleted


def remove_leftovers(
    fs: Storage,
    storage: Storage,
    records: Sequence[CheckpointRecord],
    *,
    min_age: float,
    busy: Collection[str] = (),
) -> list[str]:
    """(rank 0) Remove what crashed saves and deletes left, where shardsafe can tell it wrote it:

    - a pending directory: the data files of the save id in its name and its staged manifest, then
      the directory if that empties it;
    - a checkpoint folder without a manifest: the data files its tombstone lists (an interrupted
      delete), and the data files and in-flight marker of abandoned saves (a crashed save on URL
      storage: :func:`~shardsafe.catalog.orphans.orphaned_files`), then the folder if empty;
    - in a committed checkpoint: data files its manifest does not list (an interrupted overwrite),
      and what a tombstone beside it lists that the manifest does not;
    - a retired checkpoint (deleted, data kept for incremental checkpoints that refer to it): its
      data files once none refers to them.

    Data files another checkpoint refers to are never removed (:mod:`shardsafe.catalog.delete`).

    Litter directories of older versions (``.<name>.litter-*``) are never touched: what they hold was
    not checked; nor is an entry that is a symbolic link (a WARNING when it looks like a leftover).
    Only what has not changed for ``min_age`` seconds goes, on the storage's own clock (never this
    host's: :class:`~shardsafe.catalog.orphans.StorageClock`); entries for a checkpoint name in
    ``busy`` (a save of this run in flight) are never touched, nor the files of a save in flight of
    another process (its pending directory or in-flight marker changed within ``min_age``). Returns
    the paths removed."""
    clocks: dict[str, StorageClock] = {}
    removed: list[str] = []
    for record in records:
        if record.target in busy or (record.leftover and not PENDING_DIR.match(record.name)):
            continue
        target = link_target(record.path)
        if target is not None:
            if record.status != "committed":
                logger.warning(
                    "shardsafe: not cleaning up %s (%s): it is a symbolic link to %s, and shardsafe deletes nothing "
                    "through a link",
                    record.path,
                    record.status,
                    target,
                )
            continue
        parent = split(record.path)[0]
        clock = clocks.setdefault(parent, StorageClock(fs, parent))
        try:
            removed += _clean(fs, storage, record, min_age, clock)
        except (OSError, ValueError, CorruptCheckpointError) as err:  # one entry that cannot be judged keeps no other
            logger.error("shardsafe: could not clean up %s: %s. It stays; the next one tries again", record.path, err)
    return removed


def _clean(fs: Storage, storage: Storage, record: CheckpointRecord, min_age: float, clock: StorageClock) -> list[str]:
    """(rank 0) What :func:`remove_leftovers` removes of one entry (not a link); ``clock`` reads the
    storage's time beside it."""
    removed: list[str] = []
    if record.status == "incomplete":
        if record.leftover:
            pending = PENDING_DIR.match(record.name)
            assert pending is not None
            if not is_abandoned(fs, record.path, pending["sid"], min_age=min_age, clock=clock):
                return []
            gone = _remove(partial(remove_pending, storage, record.path), record.path)
        else:
            names = orphaned_files(fs, record.path, (), min_age=min_age)
            if not names and TOMBSTONE not in fs.list_dir(record.path):
                age = clock.age(record.path)
                if fs.list_dir(record.path) or age is None or age < min_age:
                    return []  # something else, or a folder a save in flight has just made
            gone = _remove(partial(_clear, storage, record.path, names), record.path)
        if gone:
            removed.append(record.path)
    elif record.status == "retired":  # its data goes once no checkpoint refers to it any more
        try:
            finish_deletion(storage, record.path)
        except (OSError, ValueError) as err:
            logger.error("shardsafe: could not finish removing retired checkpoint %s: %s", record.path, err)
        if not storage.is_dir(record.path):
            removed.append(record.path)
    elif record.status == "committed":
        if TOMBSTONE in fs.list_dir(record.path):
            _remove(partial(_finish, storage, record.path), fs.join(record.path, TOMBSTONE))
        for name in orphaned_files(fs, record.path, record.files, min_age=min_age):
            path = fs.join(record.path, name)
            if _remove(partial(_clear, storage, record.path, [name], rmdir=False), path):
                removed.append(path)
    return removed


def _finish(storage: Storage, path: str) -> bool:
    finish_deletion(storage, path)
    return True


def _clear(storage: Storage, path: str, names: list[str], *, rmdir: bool = True) -> bool:
    """Finish an interrupted delete, remove the data files ``names``, then the folder if empty."""
    finish_deletion(storage, path)
    delete_files(storage, path, names)
    return unlink.remove_folder(storage, path) if rmdir else True


def _remove(action: Callable[[], bool], path: str) -> bool:
    try:
        gone = action()
    except (OSError, ValueError) as err:
        logger.error(
            "shardsafe: could not remove %s, left by a crashed save: %s. It wastes space but is never read; "
            "remove it by hand if this repeats.",
            path,
            err,
        )
        return False
    if gone:
        logger.info("shardsafe: removed %s, left by a crashed save", path)
    return gone
