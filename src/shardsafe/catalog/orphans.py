"""Which leftovers of saves that never committed may go: the one rule, used by the save that commits
over a checkpoint (rank 0, right after its commit) and by the manager's cleanup; the removal itself
goes through :func:`shardsafe.catalog.delete.delete_files` (only shardsafe's names, siblings'
references kept) and :func:`shardsafe.catalog.delete.remove_pending`.

How they arise: two jobs save one path and the loser's data files were moved in (or, on an object
store, written straight in) but its manifest never committed; or a save crashed, or the filesystem
turned read-only, between moving its data files in and renaming its manifest.

An orphan is a data file (``data-<rank>-<saveid>.safetensors``, a plain file: never a folder, never
a symbolic link) in a checkpoint folder that

- no manifest there names: neither the manifest committed now (read again at the sweep: another
  writer may have committed since), nor the tombstone of a deletion under way (whose own completion,
  :func:`shardsafe.catalog.delete.finish_deletion`, decides on those files);
- no sibling refers to: committed, staged by a save in flight, or retired (its tombstone);
- no save in flight may still be writing: its save id names no pending directory beside the folder
  and no temporary manifest in it, and the save began more than the leftover age ago (a save id starts
  with its start time in seconds; on an object store a save's data objects go straight into the
  folder with nothing else to show for it, so this is how a save in flight there is told apart);
- has not changed for the leftover age (its modification time; an object's ``LastModified``, which
  for a multipart upload is when the upload began).

A manifest or tombstone there that does not validate stops the sweep of that folder (nothing is
removed), as does a folder that is a symbolic link. The leftover age must exceed the longest save
(``SHARDSAFE_LEFTOVER_AGE_SECONDS``, 3600 s; a manager's ``leftover_age``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from shardsafe.catalog import refs
from shardsafe.catalog.delete import link_target, manifest_files
from shardsafe.catalog.names import DATA_FILE, PENDING_DIR, TEMP_MANIFEST, TOMBSTONE
from shardsafe.errors import CorruptCheckpointError
from shardsafe.storage.base import MANIFEST_NAME, Storage

logger = logging.getLogger(__name__)


def orphaned_files(storage: Storage, path: str, listed: Iterable[str], *, min_age: float, now: float) -> list[str]:
    """(rank 0) The orphans (module docstring) in the checkpoint folder ``path``, whose manifest, as the
    caller read it, lists ``listed``; ``now`` is the current unix time."""
    if link_target(path) is not None:
        return []
    names = storage.list_dir(path)
    busy = {m["sid"] for m in map(TEMP_MANIFEST.match, names) if m}
    parent, target = refs.split(path)
    busy |= {m["sid"] for m in map(PENDING_DIR.match, storage.list_dir(parent)) if m and m["target"] == target}
    keep = set(listed)
    candidates = []
    for name in names:
        m = DATA_FILE.match(name)
        if m is not None and name not in keep and m["sid"] not in busy and began_before(m["sid"], now - min_age):
            candidates.append(name)
    if not candidates:
        return []
    named = _named(storage, path)
    if named is None:
        return []
    out = []
    for name in candidates:
        where = storage.join(path, name)
        if name in named or link_target(where) is not None or storage.is_dir(where):
            continue
        if _unchanged_for(storage, where, min_age, now):
            out.append(name)
    if out:
        used = refs.referenced_files(storage, path, tombstones=True)
        out = [n for n in out if n not in used]
    return out


def _named(storage: Storage, path: str) -> set[str] | None:
    """The data files the manifest and the tombstone in ``path`` name now; ``None`` (logged) when one
    of them does not validate."""
    found: set[str] = set()
    for name in (MANIFEST_NAME, TOMBSTONE):
        where = storage.join(path, name)
        try:
            found.update(manifest_files(storage.read_bytes(where), where)[1])
        except FileNotFoundError:
            continue
        except CorruptCheckpointError as err:
            logger.warning("shardsafe: not removing orphans from %s: %s", path, err)
            return None
    return found


def abandoned_pending(storage: Storage, path: str, *, min_age: float, now: float) -> list[str]:
    """(rank 0) The pending directories of saves into ``path`` (beside it, on local disks) that began
    and last changed more than ``min_age`` seconds ago: a save that failed and could not remove its
    own (a read-only remount, a crash), which :func:`~shardsafe.catalog.delete.remove_pending` removes.
    Symbolic links are left out (nothing is deleted through one)."""
    parent, target = refs.split(path)
    out = []
    for name in storage.list_dir(parent):
        m = PENDING_DIR.match(name)
        if m is None or m["target"] != target or not began_before(m["sid"], now - min_age):
            continue
        pending = storage.join(parent, name)
        if link_target(pending) is None and _unchanged_for(storage, pending, min_age, now):
            out.append(pending)
    return out


def _unchanged_for(storage: Storage, where: str, min_age: float, now: float) -> bool:
    """Whether ``where`` is there and last changed at least ``min_age`` seconds before ``now``."""
    try:
        return now - storage.mtime(where) >= min_age
    except FileNotFoundError:
        return False


def began_before(save_id: str, moment: float) -> bool:
    """Whether save ``save_id`` began before ``moment`` (unix time), as far as its id tells: shardsafe's
    save ids start with their start time in seconds, then 10 hex digits. An id of another shape tells
    nothing (True: the file's own age decides)."""
    started = save_id[:-10]
    return not started.isdigit() or int(started) < moment
