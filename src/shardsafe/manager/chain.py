"""Which checkpoint an incremental save of a :class:`~shardsafe.manager.CheckpointManager` refers to.

(rank 0 only: the save protocol takes rank 0's ``base=`` for every rank.) The newest committed
checkpoint of the manager other than the target, unless a full save is due (``full_save_every``), or
that checkpoint is damaged (a data file of its own, or one it refers to, missing or of another size
than recorded: one stat per file), refers to the target itself, or lacks a base of its own: then the
save is a full one, with a WARNING naming it and why. A full save is always safe; an incremental one
only saves bytes, and verifies every chunk it refers to (damage these stats cannot see, a flipped
byte, makes those chunks written in full: :mod:`shardsafe.engine.incremental`), so a damaged
checkpoint never stops a run from checkpointing.

When a full save is due is read from storage, never kept in memory, so that it holds across restarts
(a preemptible job may restart more often than every N saves). Each save of an incremental manager
records in its metadata :data:`COUNT`: the incremental saves since the last full one, itself included
(0 for a full save). References are one hop (a chunk refers to the checkpoint that holds its bytes,
not to the base it was compared with), so they cannot tell how many saves lie between the newest
checkpoint and the full save it still refers to; the recorded count can, and the references check it:

- a checkpoint without references counts as full (0), whatever it records;
- one with references must record a count ``k >= 1`` and refer to at most ``k`` checkpoints, each of
  them (read through its validated sibling name: its committed manifest, or the tombstone a retired
  one keeps while referred to, with the save id the reference records) counting fewer than ``k`` and
  not referring back to it.

Anything else (a manifest that does not validate, a count missing or out of range, a referenced
manifest gone or replaced, a cycle) is a chain that cannot be followed: the next save is full. Reads:
the newest candidate's manifest and at most ``full_save_every - 1`` referenced ones (a manager
remembers those it read, by save id, so in a long run each is read once); nothing is followed further,
so no manifest can make this loop.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence

from shardsafe.catalog.names import TOMBSTONE, link_target
from shardsafe.catalog.refs import check_own_files, check_ref_files, sibling, split
from shardsafe.engine.guard import mapped_errors
from shardsafe.engine.read import open_manifest
from shardsafe.errors import CheckpointError, CorruptCheckpointError
from shardsafe.format.manifest import Manifest, parse_manifest
from shardsafe.format.values import decode
from shardsafe.manager.listing import CheckpointRecord
from shardsafe.storage import Storage
from shardsafe.storage.base import MANIFEST_NAME

logger = logging.getLogger(__name__)

COUNT = "saves_since_full"
"""The metadata key of a manager's incremental saves: incremental saves since the last full one."""

Link = tuple[int, frozenset[str]]
"""What a manifest says of its place in the chain: the count it records (0 when it refers to nothing)
and the names of the checkpoints it refers to."""

Known = dict[tuple[str, str], Link]
"""Links already read, by (checkpoint name, save id): all are siblings in the manager's root. A save
id names one save, whose manifest (committed, or its tombstone once retired) says the same for good, so
a manager keeps these between saves and reads each referenced manifest once; a new process starts
empty and reads them again."""


def choose_base(
    fs: Storage,
    records: Sequence[CheckpointRecord],
    target: str,
    *,
    every: int,
    exclude: Collection[str] = (),
    known: Known | None = None,
) -> tuple[str | None, int]:
    """(rank 0) The path of the base for the save to ``target`` (a checkpoint name), or ``None`` for a
    full save, and the count this save records under :data:`COUNT`. ``records`` come from a scan of the
    root, oldest first; ``every`` is ``full_save_every``; ``known`` is updated with what was read."""
    for record in reversed(records):
        if record.status != "committed" or record.name == target or record.name in exclude:
            continue
        if link_target(record.path) is not None:
            continue  # a link to a checkpoint elsewhere is no base: a reference may only name a sibling
        try:
            with mapped_errors("choose a base", record.path):
                manifest = open_manifest(fs, record.path)
                check_own_files(fs, record.path, manifest)  # its files, and its own bases', are there
                check_ref_files(fs, record.path, manifest)
                if target in manifest.refs:
                    return None, 0  # it refers to data in the target, which this save replaces
                since = saves_since_full(fs, record.path, manifest, {} if known is None else known)
        except (CheckpointError, OSError) as err:
            logger.warning("shardsafe: %s cannot serve as a base (%s); this save is a full one", record.path, err)
            return None, 0
        if since + 1 >= every:
            return None, 0
        return record.path, since + 1
    return None, 0


def saves_since_full(fs: Storage, path: str, manifest: Manifest, known: Known) -> int:
    """(rank 0) The incremental saves since the last full one, up to the checkpoint at ``path`` with
    ``manifest`` (0: it is full). Raises :class:`CorruptCheckpointError` naming what breaks the chain.
    Reads the manifests it refers to that ``known`` lacks; leaves in ``known`` the links of ``path``
    and of what it refers to (what the next save's check needs)."""
    count, names = _link(manifest, path)
    if len(names) > count:
        raise CorruptCheckpointError(
            f"{path}: refers to {len(names)} checkpoints but records {count} save(s) since a full one"
        )
    own = split(path)[1]
    keep: Known = {(own, manifest.save_id): (count, names)}
    for name, ref in sorted(manifest.refs.items()):
        base = sibling(fs, path, name)
        key = (name, ref.save_id)
        link = known.get(key)
        if link is None:
            link = _link(_referenced_manifest(fs, base, ref.save_id), base)
        keep[key] = link
        if own in link[1]:
            raise CorruptCheckpointError(f"{path}: refers to {name!r}, which refers back to it (a cycle)")
        if link[0] >= count:
            raise CorruptCheckpointError(
                f"{path}: records {count} save(s) since a full one, but {name!r}, which it refers to, records {link[0]}"
            )
    known.clear()
    known.update(keep)
    return count


def _link(manifest: Manifest, path: str) -> Link:
    """The count a manifest records (an integer >= 1 when it refers to checkpoints; 0 when it refers to
    none, whatever it records) and the names it refers to."""
    if not manifest.refs:
        return 0, frozenset()
    metadata = decode(manifest.metadata, f"{path}: metadata", lambda ref: ref)
    value = metadata.get(COUNT) if isinstance(metadata, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CorruptCheckpointError(
            f"{path}: has references but metadata[{COUNT!r}] is {value!r}, not a count >= 1 (not saved by an "
            "incremental CheckpointManager, or altered)"
        )
    return value, frozenset(manifest.refs)


def _referenced_manifest(fs: Storage, base: str, save_id: str) -> Manifest:
    """The manifest of the save ``save_id`` of the referenced checkpoint ``base``: its committed
    manifest, or the tombstone it keeps once retired while others refer to it."""
    for name in (MANIFEST_NAME, TOMBSTONE):
        where = fs.join(base, name)
        try:
            manifest = parse_manifest(fs.read_bytes(where), where)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            continue
        if manifest.save_id == save_id:
            return manifest
    raise CorruptCheckpointError(f"{base}: no manifest of save {save_id} (the save referred to) is there")
