"""Every delete shardsafe makes, on every backend, goes through :func:`delete_files`: it removes only
names shardsafe writes (:func:`shardsafe.catalog.names.is_own`: data files, its temporary and
tombstone manifests, and the staged manifest inside a pending directory), each a plain name inside
the directory it is given, and fsyncs that directory after. Directories are removed only when empty;
nothing is ever removed recursively.

Where the names come from:

- a checkpoint (retention; an overwrite's old files): its manifest, after it passed the loader's
  own validation (:func:`~shardsafe.format.manifest.parse_manifest`);
- an aborted save: the names that save itself writes (``data-<rank>-<saveid>`` for every rank of
  the save, its staged or temporary manifest), which are known from its save id and world size;
- leftovers of crashed saves: a pending directory's own name gives the save id whose files it may
  hold; a crashed delete left its tombstone, a validated manifest.

Deleting a checkpoint first renames ``MANIFEST.json`` to the tombstone ``.MANIFEST.json.deleting``
(atomically: from that instant the checkpoint is uncommitted, never half-committed) and fsyncs the
folder, then removes the data files the tombstone lists, then the tombstone, then the empty folder.
A crash anywhere leaves either the committed checkpoint or an uncommitted one with its tombstone,
which :func:`finish_deletion` completes later from the same validated names.

Incremental checkpoints (format v2) refer to data files of sibling checkpoints: a data file that a
sibling's manifest (committed, or staged by a save in flight) refers to is never removed
(:func:`shardsafe.catalog.refs.referenced_files`). A deleted checkpoint whose files are still
referenced keeps them and its tombstone (it is no longer committed, listed or loadable); once the
last checkpoint referring to them is deleted, they go too.

An overwrite of a checkpoint B keeps the old data files that a sibling C refers to; B's new manifest
no longer lists them, and nothing is written at the overwrite: their record is C's own ``refs``
table (B's name, the old save id, each file's size), durable as long as C's manifest or tombstone
is. Deleting C, once its own files are gone and while its tombstone is still there (a crash repeats
the step from the same tombstone), removes from B the files that table names when all of these
hold (:func:`_release_replaced`):

- B holds a manifest or tombstone, every one of them validates, none carries the save id named
  (that save is B's current or retired one: its own deletion governs it), and none lists the file
  (a folder that is no checkpoint, or a damaged one, loses nothing);
- no save of that id is in flight into B (its pending directory beside B, or its temporary
  manifest in B);
- the file has the size C recorded (it is the file C referred to);
- no other sibling refers to it: committed, staged by a save in flight, or retired (a tombstone
  other than C's; that sibling's own deletion releases it later);
- the name is a data file of that save id, as the parser checked; a reference to C itself
  releases nothing.

A deleted B whose folder still holds old files that a sibling refers to keeps its tombstone (it is
``retired``) until they are free, so the record of B stays findable; deleting their last referrer
removes them, then finishes B. An overwrite of C itself (the last referrer) releases the same way,
from C's replaced manifest, right after the commit (:func:`release_references`, like the removal of
C's own stale files); a crash in between leaves unlisted data files in a committed B (or a retired B
no one refers to), which the manager's cleanup of leftovers removes by name once old enough.

Nothing is deleted or retired through a symbolic link: a checkpoint folder (or a sibling it refers
to, or a pending directory) that is a link is refused by :func:`delete_checkpoint`,
:func:`finish_deletion`, :func:`remove_pending` and the release of referenced files
(:func:`link_target`), so that a root entry linking to a checkpoint elsewhere (another run's, a
kept copy) never costs that checkpoint its files. The link itself stays there: shardsafe did not write
it. Only an explicit ``shardsafe.delete(link)`` removes a link, the link alone (:func:`remove_link`:
one that leads to a checkpoint of shardsafe, or to nothing), as a framework replaces its ``last``
link to a checkpoint.

On object stores (and ``file://``) a save's data files go straight into its target, with nothing
beside them until its manifest commits: a save in flight there is told from a replaced one only by
its save id, which is new per attempt (its time and 40 random bits), unknown to any manifest
written before it started.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Iterable

from shardsafe.catalog import refs, unlink
from shardsafe.catalog.names import (
    DATA_FILE,
    PENDING_DIR,
    STAGED_MANIFEST,
    TOMBSTONE,
    basename,
    data_file,
    link_target,
    pending_name,
    temp_manifest,
)
from shardsafe.errors import CorruptCheckpointError
from shardsafe.format.manifest import parse_manifest
from shardsafe.storage.base import MANIFEST_NAME, Storage

logger = logging.getLogger(__name__)


def delete_files(storage: Storage, directory: str, names: Iterable[str], *, side: Collection[str] = ()) -> list[str]:
    """Remove ``names`` from ``directory`` through the gate (:func:`shardsafe.catalog.unlink.remove`),
    less the data files another checkpoint beside ``directory`` refers to (kept, logged); returns the
    names removed. ``side``: the side files among ``names``, taken from a validated manifest or from the save
    that wrote them. Raises ``ValueError`` without removing anything if one of them is not a name
    shardsafe writes there, ``OSError`` if a removal fails."""
    todo = sorted(set(names))
    in_pending = PENDING_DIR.match(basename(directory)) is not None
    if not in_pending and any(DATA_FILE.match(n) for n in todo):
        kept = refs.referenced_files(storage, directory) & set(todo)
        if kept:
            logger.info("shardsafe: keeping %s in %s: other checkpoints refer to them", sorted(kept), directory)
            todo = [n for n in todo if n not in kept]
    return unlink.remove(storage, directory, todo, side=side)


def refuse_link(path: str, what: str) -> None:
    """Raise ``ValueError`` (deleting nothing) when the folder ``path`` is a symbolic link."""
    target = link_target(path)
    if target is not None:
        raise ValueError(
            f"refusing to {what} {path}: it is a symbolic link to {target}, and shardsafe deletes nothing through "
            "a link (what it points to is not this folder's to delete). Remove the link by hand if it should go."
        )


def remove_link(path: str) -> str:
    """(one process: :func:`shardsafe.delete` of a path that is a symbolic link) Remove the link
    ``path`` (a local path or ``file://`` URL) itself, never what it leads to, when it leads to a
    checkpoint folder of shardsafe (committed, or with a delete's tombstone) or to nothing (its
    checkpoint is gone); returns where it led. Raises ``ValueError``, removing nothing, when ``path`` is
    not a link or leads to anything else: shardsafe removes links to its checkpoints only."""
    target = link_target(path)
    if target is None:
        raise ValueError(f"{path} is not a symbolic link")
    local = (path.removeprefix("file://") if path.startswith("file://") else path).rstrip("/") or "/"
    ours = os.path.isdir(target) and any(os.path.isfile(os.path.join(target, n)) for n in (MANIFEST_NAME, TOMBSTONE))
    if os.path.lexists(target) and not ours:
        raise ValueError(
            f"refusing to remove the symbolic link {path}: it leads to {target}, which is not a shardsafe checkpoint "
            "(no MANIFEST.json there); shardsafe removes only links to its own checkpoints. Remove it by hand if it "
            "should go."
        )
    unlink.remove_link(local)  # the link, not its target
    return target


def manifest_files(raw: bytes, where: str) -> tuple[str, list[str]]:
    """(save id, data file names) of manifest bytes that pass the loader's validation; names that
    are not data files (allowed by the format, never written by shardsafe) are left out, with a
    WARNING. Raises :class:`CorruptCheckpointError` if the manifest does not validate."""
    manifest = parse_manifest(raw, where)
    names = sorted(manifest.files)
    other = [n for n in names if not DATA_FILE.match(n)]
    if other:
        logger.warning("shardsafe: %s lists files shardsafe does not write, never deleted: %s", where, other)
    return manifest.save_id, [n for n in names if DATA_FILE.match(n)]


def side_files_of(raw: bytes, where: str) -> list[str]:
    """The side files (format v3) that manifest bytes list, once they pass the loader's validation (which
    checked every name); raises :class:`CorruptCheckpointError` if they do not."""
    return sorted(parse_manifest(raw, where).side_files)


def _read(storage: Storage, path: str) -> bytes | None:
    try:
        return storage.read_bytes(path)
    except FileNotFoundError:
        return None


def delete_checkpoint(storage: Storage, path: str) -> list[str]:
    """(rank 0: retention) Delete the committed checkpoint at ``path`` (see the module docstring);
    returns the data files removed. Raises :class:`CorruptCheckpointError`, deleting nothing, if its
    manifest does not validate, ``ValueError``, deleting nothing, if ``path`` is a symbolic link, and
    ``OSError`` if a step fails (what is left is uncommitted and carries its tombstone)."""
    refuse_link(path, "delete the checkpoint")
    where = storage.join(path, MANIFEST_NAME)
    raw = storage.read_bytes(where)
    manifest_files(raw, where)  # validated before the checkpoint is touched
    storage.retire_manifest(path, TOMBSTONE)
    storage.sync_dir(path)  # the manifest is gone for good before any data file goes
    return _finish(storage, path)


def finish_deletion(storage: Storage, path: str) -> list[str]:
    """(rank 0: leftover cleanup) Complete a delete that crashed: remove the data files the tombstone
    of ``path`` lists (not those a committed manifest there lists, if a later save committed one),
    the old files of overwritten siblings it was the last to refer to, then the tombstone, then the
    folder if empty. Nothing when there is no tombstone, when the tombstone or the manifest beside
    it does not validate, or when ``path`` is a symbolic link (logged)."""
    try:
        refuse_link(path, "finish the deletion of")
        return _finish(storage, path)
    except CorruptCheckpointError as err:
        logger.error("shardsafe: not finishing the deletion of %s: %s", path, err)
        return []
    except ValueError as err:
        logger.warning("shardsafe: %s", err)
        return []


def _finish(storage: Storage, path: str) -> list[str]:
    tomb = storage.join(path, TOMBSTONE)
    raw = _read(storage, tomb)
    if raw is None:
        return []
    _, names = manifest_files(raw, tomb)
    side = side_files_of(raw, tomb)
    live = _read(storage, storage.join(path, MANIFEST_NAME))
    if live is not None:  # a later save committed here: its files stay
        _, keep = manifest_files(live, storage.join(path, MANIFEST_NAME))
        keep += side_files_of(live, storage.join(path, MANIFEST_NAME))
        names = [n for n in names if n not in set(keep)]
        side = [n for n in side if n not in set(keep)]
    removed = delete_files(storage, path, names)
    if side:  # never referred to by a sibling: they go with the data files, before the tombstone
        delete_files(storage, path, side, side=side)
    if len(removed) < len(names):
        return removed  # others refer to the rest: the tombstone stays until they no longer do
    if live is None and _still_referenced(storage, path, names):
        return removed  # files an earlier overwrite kept here: the tombstone names the folder's last save
    _release_replaced(storage, path, raw, tomb)  # before the tombstone goes: a crash repeats it
    delete_files(storage, path, [TOMBSTONE])
    if live is None:
        unlink.remove_folder(storage, path)
    _release_bases(storage, path, raw, tomb)
    return removed


def _still_referenced(storage: Storage, path: str, gone: list[str]) -> bool:
    """Whether ``path`` still holds data files (not among ``gone``) that a sibling refers to: the
    old files of an overwritten save, kept for an incremental checkpoint. A retired sibling counts
    too: its own deletion, finished later, releases them from this tombstone's record."""
    left = [n for n in storage.list_dir(path) if DATA_FILE.match(n) and n not in gone]
    return bool(left) and bool(refs.referenced_files(storage, path, tombstones=True) & set(left))


def _release_bases(storage: Storage, path: str, raw: bytes, where: str) -> None:
    """After the checkpoint at ``path`` is gone: finish the deletion of the retired checkpoints it
    referred to (a tombstone and no manifest), whose files only referrers like it kept."""
    for ref in sorted(parse_manifest(raw, where).refs):
        base = refs.sibling(storage, path, ref)
        if storage.exists(storage.join(base, TOMBSTONE)) and not storage.exists(storage.join(base, MANIFEST_NAME)):
            finish_deletion(storage, base)


def _release_replaced(storage: Storage, path: str, raw: bytes, where: str) -> None:
    """(rank 0, deleting the checkpoint at ``path``; its own data files are gone, its tombstone
    ``raw`` at ``where`` is still there) Remove the files of sibling saves that were overwritten while
    ``path`` referred to them, and that nothing else refers to any more (module docstring)."""
    own = refs.split(path)[1]
    for ref, entry in refs.bases(path, parse_manifest(raw, where)):
        base = refs.sibling(storage, path, ref)
        if link_target(base) is not None:
            logger.warning("shardsafe: not removing replaced files of %s: it is a symbolic link", base)
            continue
        todo = _replaced_files(storage, base, entry.save_id, {n: f.size for n, f in entry.files.items()})
        if not todo:
            continue
        used = refs.referenced_files(storage, base, tombstones=True, ignore=own)
        todo = [n for n in todo if n not in used]
        if todo:
            logger.info(
                "shardsafe: removing %s from %s: its save was replaced and %s was its last referrer", todo, base, own
            )
            delete_files(storage, base, todo)


def _replaced_files(storage: Storage, base: str, save_id: str, sizes: dict[str, int]) -> list[str]:
    """The files ``sizes`` (data files of ``save_id``, as a validated ``refs`` entry lists them) that
    are still in ``base`` as a replaced save's leftovers: ``base`` holds a validated manifest or
    tombstone of another save that does not list them, no save ``save_id`` is in flight there, and
    each has the size recorded. ``[]`` for anything else (logged where it looks hostile)."""
    records = []
    for name in (MANIFEST_NAME, TOMBSTONE):
        rec = _read(storage, storage.join(base, name))
        if rec is None:
            continue
        try:
            records.append(manifest_files(rec, storage.join(base, name)))
        except CorruptCheckpointError as err:
            logger.warning("shardsafe: not removing replaced files of %s: %s", base, err)
            return []
    if not records or any(sid == save_id for sid, _ in records):
        return []  # not a checkpoint of shardsafe, or that save is its current (or retired) one
    listed = {n for _, names in records for n in names}
    parent, name = refs.split(base)
    if storage.exists(storage.join(parent, pending_name(name, save_id))) or storage.exists(
        storage.join(base, temp_manifest(save_id))
    ):
        logger.warning("shardsafe: not removing files of save %s from %s: that save is in flight", save_id, base)
        return []
    out = []
    for n, size in sorted(sizes.items()):
        m = DATA_FILE.match(n)
        if m is None or m["sid"] != save_id or n in listed:
            continue
        try:
            actual = storage.size(storage.join(base, n))
        except (FileNotFoundError, CorruptCheckpointError):
            continue
        if actual != size:
            logger.warning(
                "shardsafe: not removing %s from %s: %d bytes, the referrer recorded %d", n, base, actual, size
            )
            continue
        out.append(n)
    return out


def stale_files(old: bytes | None, new: bytes, where: str) -> list[str]:
    """(rank 0, publishing an overwrite) The data files of the replaced manifest ``old`` that the new
    one does not list, for removal once the new one is committed. ``[]`` (with a WARNING) when the
    old manifest does not validate: its files are then left alone."""
    if old is None:
        return []
    try:
        _, before = manifest_files(old, where)
    except CorruptCheckpointError as err:
        logger.warning("shardsafe: the replaced manifest does not validate, its files are left in place: %s", err)
        return []
    _, after = manifest_files(new, where)
    return [n for n in before if n not in set(after)]


def stale_side_files(old: bytes | None, new: bytes, where: str) -> list[str]:
    """(rank 0, publishing an overwrite) The side files of the replaced manifest ``old`` that the new one
    does not list; ``[]`` when the old manifest does not validate (:func:`stale_files` logged it)."""
    if old is None:
        return []
    try:
        before = side_files_of(old, where)
    except CorruptCheckpointError:
        return []
    after = set(side_files_of(new, where))
    return [n for n in before if n not in after]


def release_references(storage: Storage, path: str, old: bytes | None, where: str) -> None:
    """(rank 0, an overwrite of ``path`` committed, after its stale files went) What the replaced
    manifest ``old`` referred to and nothing refers to any more: old files of overwritten siblings,
    and retired siblings kept for it (as the deletion of the old checkpoint would release them; the
    new manifest counts as a referrer like any other). Nothing when ``old`` does not validate."""
    if old is None:
        return
    try:
        parse_manifest(old, where)
    except CorruptCheckpointError:
        return  # stale_files logged it
    _release_replaced(storage, path, old, where)
    _release_bases(storage, path, old, where)


def discard_save(
    storage: Storage, pending: str, target: str, save_id: str, world_size: int, side: Collection[str] = ()
) -> None:
    """(every rank, once "abort" is decided; idempotent) Remove what save ``save_id`` wrote: every
    rank's data file, its staged or temporary manifest, the side files it wrote (``side``: rank 0 knows
    them), then its pending directory if empty. Files of this save id that an interrupted publish had moved
    into ``target`` go too, unless a manifest committed there lists them."""
    own = [data_file(r, save_id) for r in range(world_size)]
    if pending != target and storage.is_dir(pending):  # another rank may have removed it already
        delete_files(storage, pending, [*own, *STAGED_MANIFEST, *side], side=side)
        unlink.remove_folder(storage, pending)
    storage.cancel_uploads(target, save_id)
    if not storage.is_dir(target):
        return
    keep: set[str] = set()
    live = _read(storage, storage.join(target, MANIFEST_NAME))
    if live is not None:
        try:
            sid, listed = manifest_files(live, storage.join(target, MANIFEST_NAME))
            listed += side_files_of(live, storage.join(target, MANIFEST_NAME))
        except CorruptCheckpointError:  # its side files stay foreign: none of this save's names is removed
            sid, listed = "", list(side)
        if sid == save_id:
            return  # this save is committed after all: its files are the checkpoint's
        keep = set(listed)
    delete_files(storage, target, [n for n in [*own, temp_manifest(save_id), *side] if n not in keep], side=side)


def _staged_side_files(storage: Storage, pending: str) -> list[str]:
    """The side files the staged manifest in ``pending`` lists, when it validates (else none: they stay)."""
    where = storage.join(pending, MANIFEST_NAME)
    try:
        return side_files_of(storage.read_bytes(where), where)
    except (FileNotFoundError, CorruptCheckpointError) as err:
        logger.warning("shardsafe: the staged manifest %s does not validate; its side files stay: %s", where, err)
        return []


def remove_pending(storage: Storage, pending: str) -> bool:
    """(rank 0: leftover cleanup) Remove a crashed save's pending directory: the data files of the save
    id its name carries, its staged manifest and the side files that manifest lists (side files of a save
    that crashed before staging its manifest are not known as its own: they stay, logged), then the
    directory if that left it empty. Returns
    whether it is gone; anything else in it stays (logged). ``ValueError``, deleting nothing, for a
    name that is not a pending directory's or a symbolic link."""
    m = PENDING_DIR.match(basename(pending))
    if m is None:
        raise ValueError(f"{pending} is not a pending directory name of shardsafe")
    refuse_link(pending, "clean up the pending directory")
    sid = m.group("sid")
    names = storage.list_dir(pending)
    side = _staged_side_files(storage, pending) if MANIFEST_NAME in names else []
    mine = [
        n
        for n in names
        if n in STAGED_MANIFEST or n in side or ((d := DATA_FILE.match(n)) is not None and d["sid"] == sid)
    ]
    delete_files(storage, pending, mine, side=side)
    if unlink.remove_folder(storage, pending):
        return True
    logger.warning(
        "shardsafe: %s holds files shardsafe did not write there (%s); left in place",
        pending,
        [n for n in names if n not in mine][:5],
    )
    return False
