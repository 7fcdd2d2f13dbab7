"""Which leftovers of saves that never committed may go: the one rule, used by the save that commits
over a checkpoint (rank 0, right after its commit) and by the manager's cleanup; the removal itself
goes through :func:`shardsafe.catalog.delete.delete_files` (only shardsafe's names, siblings'
references kept) and :func:`shardsafe.catalog.delete.remove_pending`.

How they arise: two jobs save one path and the loser's data files were moved in (or, on URL
storage, written straight in) but its manifest never committed; a save crashed, or the filesystem
turned read-only, between moving its data files in and committing; a save on URL storage whose rank
0 died left its data files and its in-flight marker.

**Ages are read on the storage's own clock, never the host's.** A sweep that has something to judge
writes a clock probe (:data:`~shardsafe.catalog.names.CLOCK_PROBE`, an empty file) where the
candidates are, reads the modification time the storage gave it, and removes it
(:class:`StorageClock`); a candidate's age is that time less its own modification time. So a host
whose clock is hours ahead (or behind) of the saving host's, or of the storage's, removes nothing
sooner (or later) than the rule says.

A save in flight is recognised by what it left where the sweep looks: on a local disk its pending
directory beside the checkpoint (``.<name>.staging-<saveid>``); on URL storage (object stores,
``file://``), where its data files go straight into the checkpoint, its **in-flight marker**, the
empty temporary manifest ``.MANIFEST.json.tmp-<saveid>`` that rank 0 writes before any data file
(:func:`~shardsafe.catalog.names.in_flight_marker`). A save is **abandoned** once nothing of it has
changed for the leftover age: its marker (or pending directory) and every data file of its save id.

An orphan is a data file (``data-<rank>-<saveid>.safetensors``, a regular file: never a folder, a
symbolic link, a FIFO or a socket) in a checkpoint folder that

- no manifest there names: neither the manifest committed now (read again at the sweep: another
  writer may have committed since), nor the tombstone of a deletion under way (whose own completion,
  :func:`shardsafe.catalog.delete.finish_deletion`, decides on those files);
- no sibling refers to: committed, staged by a save in flight, or retired (its tombstone);
- belongs to an abandoned save: no pending directory of its save id beside the folder, and its
  marker, if any, and every unlisted data file of its save id last changed at least the leftover age
  ago; its save id, whose first digits are its start time on the saving host, does not say it began
  within the leftover age on this host (that clock only ever keeps a file, never makes one go).

An abandoned save's marker goes with its files (and alone, when it has none), and so do clock probes
older than the leftover age (a sweep killed between writing and removing one).

A manifest or tombstone there that does not validate stops the sweep of that folder (nothing is
removed), as does a folder that is a symbolic link. The leftover age must exceed the longest save
(``SHARDSAFE_LEFTOVER_AGE_SECONDS``, 3600 s; a manager's ``leftover_age``). A save that runs longer
may have its files removed by another process's sweep: its publish then finds them missing, with one
listing, and fails without committing (the checkpoint there stays as it was); only a removal landing
between that listing and the commit step itself would go unseen.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable

from shardsafe.catalog import refs, unlink
from shardsafe.catalog.delete import manifest_files
from shardsafe.catalog.names import (
    CLOCK_PROBE,
    DATA_FILE,
    PENDING_DIR,
    TEMP_MANIFEST,
    TOMBSTONE,
    clock_probe,
    link_target,
)
from shardsafe.errors import CorruptCheckpointError
from shardsafe.storage.base import MANIFEST_NAME, Storage

logger = logging.getLogger(__name__)


class StorageClock:
    """The storage's own "now" where ``folder`` is: read once, when first asked, from a clock probe
    written there (:meth:`Storage.stamp`) and removed at once through the gate; later readings add
    the time elapsed since on this host's monotonic clock (rates agree; only offsets differ)."""

    def __init__(self, storage: Storage, folder: str) -> None:
        self.storage = storage
        self.folder = folder
        self._at: tuple[float, float] | None = None

    def now(self) -> float:
        if self._at is None:
            name = clock_probe(f"{int(time.time())}{uuid.uuid4().hex[:10]}")
            try:
                stamped = self.storage.stamp(self.storage.join(self.folder, name))
            finally:
                unlink.remove(self.storage, self.folder, [name])
            self._at = (stamped, time.monotonic())
        stamped, then = self._at
        return stamped + (time.monotonic() - then)

    def age(self, where: str) -> float | None:
        """Seconds since ``where`` (or anything directly in it) last changed, on the storage's clock;
        ``None`` when it is gone."""
        try:
            changed = self.storage.mtime(where)
        except FileNotFoundError:
            return None
        return self.now() - changed


def orphaned_files(
    storage: Storage, path: str, listed: Iterable[str], *, min_age: float, clock: StorageClock | None = None
) -> list[str]:
    """(rank 0) What may go from the checkpoint folder ``path`` (module docstring), whose manifest, as
    the caller read it, lists ``listed`` (nothing, for a folder without one): the orphans, the markers
    of abandoned saves and old clock probes. ``clock``: one to share between calls (else one is made,
    probing ``path`` only if there is something to judge)."""
    if link_target(path) is not None:
        return []
    kinds = storage.entries(path)
    keep = set(listed)
    files: dict[str, list[str]] = {}
    markers: dict[str, str] = {}
    probes = []
    for name, kind in kinds.items():
        if kind != "file":
            continue  # a folder, link, FIFO or socket named like ours is not ours
        if (m := DATA_FILE.match(name)) is not None:
            if name not in keep:
                files.setdefault(m["sid"], []).append(name)
        elif (m := TEMP_MANIFEST.match(name)) is not None:
            markers[m["sid"]] = name
        elif CLOCK_PROBE.match(name):
            probes.append(name)
    if not files and not markers and not probes:
        return []
    parent, target = refs.split(path)
    pending = {m["sid"] for m in map(PENDING_DIR.match, storage.list_dir(parent)) if m and m["target"] == target}
    sids = sorted((set(files) | set(markers)) - pending)
    if not sids and not probes:
        return []
    named = _named(storage, path)
    if named is None:
        return []
    clock = clock or StorageClock(storage, path)
    out = [n for n in probes if _old(clock, storage.join(path, n), min_age)]
    for sid in sids:
        mine = [n for n in files.get(sid, []) if n not in named]
        items = sorted([*mine, *([markers[sid]] if sid in markers else [])])
        if not items or not began_before(sid, time.time() - min_age):
            continue
        if all(_old(clock, storage.join(path, n), min_age) for n in items):
            out.extend(items)
    if any(DATA_FILE.match(n) for n in out):
        used = refs.referenced_files(storage, path, tombstones=True)
        out = [n for n in out if n not in used]
    return sorted(out)


def _old(clock: StorageClock, where: str, min_age: float) -> bool:
    age = clock.age(where)
    return age is not None and age >= min_age


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


def abandoned_pending(
    storage: Storage, path: str, *, min_age: float, clock: StorageClock | None = None, siblings: bool = False
) -> list[str]:
    """(rank 0) The pending directories of saves into ``path`` (beside it, on local disks), and with
    ``siblings`` of saves into any other folder beside it, that are abandoned: unchanged, they and
    everything directly in them, for ``min_age`` seconds on the storage's clock (read beside them), and
    not begun within it as far as their save id tells: a save that failed and could not remove its own
    (a read-only remount, a crash, a kill), which :func:`~shardsafe.catalog.delete.remove_pending`
    removes. A killed save's pending directory is most often beside a path nothing saves to again (the
    next save goes to the next step), so a save's sweep looks at its siblings' too: the rule is the
    same, and a pending directory holds nothing a committed checkpoint reads. Symbolic links are left
    out (nothing is deleted through one)."""
    parent, target = refs.split(path)
    found = []
    for name, kind in sorted(storage.entries(parent).items()):
        m = PENDING_DIR.match(name)
        if m is not None and (siblings or m["target"] == target) and kind == "dir":  # not a link, a FIFO, a file
            found.append((name, m["sid"]))
    if not found:
        return []
    clock = clock or StorageClock(storage, parent)
    out = []
    for name, sid in found:
        pending = storage.join(parent, name)
        if is_abandoned(storage, pending, sid, min_age=min_age, clock=clock):
            out.append(pending)
    return out


def is_abandoned(storage: Storage, pending: str, save_id: str, *, min_age: float, clock: StorageClock) -> bool:
    """Whether the pending directory ``pending`` of save ``save_id`` is abandoned (see
    :func:`abandoned_pending`); never one that is a symbolic link."""
    if link_target(pending) is not None or not began_before(save_id, time.time() - min_age):
        return False
    return _old(clock, pending, min_age)


def began_before(save_id: str, moment: float) -> bool:
    """Whether save ``save_id`` began before ``moment`` (unix time on this host), as far as its id
    tells: shardsafe's save ids start with their start time in seconds (on the saving host), then 10
    hex digits. An id of another shape tells nothing (True: the files' own ages decide). Used only to
    keep a file, never to make one go, so hosts' clocks that disagree cost nothing but a later removal."""
    started = save_id[:-10]
    return not (started.isascii() and started.isdigit()) or int(started) < moment
