"""Deleting checkpoints that retention lets go, and the leftovers of crashed saves.

Called by rank 0 only, after a new checkpoint has committed. A checkpoint is deleted manifest
first, so a half-deleted one is never taken for committed. One failed delete is logged and the rest
go on: a full or flaky disk must not turn a successful save into a crash.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shardsafe.manager.listing import CheckpointRecord
from shardsafe.manager.retention import RetentionPolicy
from shardsafe.manager.rootfs import RootFS
from shardsafe.storage.base import MANIFEST_NAME

logger = logging.getLogger(__name__)

_DATA_FILE = re.compile(r"^data-\d+-.+\.safetensors$")


@dataclass(frozen=True)
class _Candidate:
    step: int
    metrics: Mapping[str, Any]
    record: CheckpointRecord


def delete_checkpoint(fs: RootFS, record: CheckpointRecord) -> None:
    """Remove one checkpoint directory: its ``MANIFEST.json`` first (from then on it is no longer
    committed, whatever happens next), then everything else. Raises ``OSError`` on failure."""
    fs.remove_file(fs.join(record.path, MANIFEST_NAME))
    fs.remove_tree(record.path)


def apply_retention(
    fs: RootFS,
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
        try:
            delete_checkpoint(fs, record)
        except OSError as err:
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
    fs: RootFS,
    records: Sequence[CheckpointRecord],
    *,
    min_age: float,
    busy: Collection[str] = (),
    now: float | None = None,
) -> list[str]:
    """(rank 0) Remove what crashed saves left: staging and litter directories, directories without a
    manifest, and data files in a committed checkpoint that its manifest does not list (an overwrite
    that crashed). Only what has not changed for ``min_age`` seconds goes; entries for a checkpoint
    name in ``busy`` (a save of this run in flight) are never touched. Returns the paths removed."""
    now = time.time() if now is None else now
    removed: list[str] = []
    for record in records:
        if record.target in busy:
            continue
        if record.status == "incomplete":
            old = record.created is not None and now - record.created >= min_age
            if old and _remove(fs, record.path, tree=True):
                removed.append(record.path)
        elif record.status == "committed":
            listed = set(record.files)
            for name in fs.list_dir(record.path):
                if not _DATA_FILE.match(name) or name in listed:
                    continue
                path = fs.join(record.path, name)
                try:
                    age = now - fs.mtime(path)
                except FileNotFoundError:
                    continue
                if age >= min_age and _remove(fs, path, tree=False):
                    removed.append(path)
    return removed


def _remove(fs: RootFS, path: str, *, tree: bool) -> bool:
    try:
        if tree:
            fs.remove_tree(path)
        else:
            fs.remove_file(path)
    except OSError as err:
        logger.error(
            "shardsafe: could not remove %s, left by a crashed save: %s. It wastes space but is never read; "
            "remove it by hand if this repeats.",
            path,
            err,
        )
        return False
    logger.info("shardsafe: removed %s, left by a crashed save", path)
    return True
