"""References between sibling checkpoints (format v2, incremental saves): where a referenced file
lives, the rules a reader applies before it touches one, and which files of a checkpoint the others
under the same parent still refer to (so that no delete removes them).

A reference is a single plain name (validated like a file name by the manifest parser) of a
checkpoint beside the one that refers to it: ``<parent>/<ref>/<file>``. A checkpoint never refers to
itself, and references are one hop: the referenced files hold the bytes, whatever happened to the
referenced checkpoint's own manifest (retention retires it but keeps the files that others use).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping

from shardsafe.catalog.names import DATA_FILE, PENDING_DIR, STAGED_MANIFEST, TOMBSTONE, link_target
from shardsafe.errors import CheckpointNotFoundError, CorruptCheckpointError
from shardsafe.format.manifest import Chunk, Manifest, parse_manifest
from shardsafe.format.model import FileEntry, RefEntry
from shardsafe.storage import is_remote
from shardsafe.storage.base import MANIFEST_NAME, Storage

logger = logging.getLogger(__name__)


def split(path: str) -> tuple[str, str]:
    """(parent, name) of a checkpoint path: a local path (made absolute) or a URL."""
    if is_remote(path):
        head, _, name = path.rstrip("/").rpartition("/")
        return head, name
    full = os.path.abspath(path)
    return os.path.dirname(full), os.path.basename(full)


def sibling(storage: Storage, path: str, name: str) -> str:
    """The path of the checkpoint ``name`` beside ``path``."""
    return storage.join(split(path)[0], name)


def bases(path: str, manifest: Manifest) -> list[tuple[str, RefEntry]]:
    """The sibling checkpoints the checkpoint at ``path`` refers to, sorted: the one place the rule
    "a checkpoint may not refer to itself" lives (readers refuse such a manifest, :func:`check_refs`;
    the delete rule never follows such a reference)."""
    own = split(path)[1]
    return [(ref, entry) for ref, entry in sorted(manifest.refs.items()) if ref != own]


def check_refs(path: str, manifest: Manifest) -> None:
    """(every reader, after parsing) A checkpoint may not refer to itself."""
    own = split(path)[1]
    if len(bases(path, manifest)) != len(manifest.refs):
        raise CorruptCheckpointError(
            f"{path}: MANIFEST.json refers to its own checkpoint {own!r} as a base; a reference must name a "
            "sibling checkpoint. Load an older checkpoint."
        )


def chunk_path(storage: Storage, path: str, chunk: Chunk) -> str:
    """Where the bytes of ``chunk`` of the checkpoint at ``path`` live."""
    if chunk.ref is None:
        return storage.join(path, chunk.file)
    return storage.join(sibling(storage, path, chunk.ref), chunk.file)


def missing_base(path: str, manifest: Manifest, ref: str, file: str, where: str) -> CheckpointNotFoundError:
    """The error for a referenced file that is not there: the base was moved, renamed or deleted."""
    return CheckpointNotFoundError(
        f"{path} is an incremental checkpoint: it refers to data of its base checkpoint {ref!r} (save id "
        f"{manifest.refs[ref].save_id}), but {where} is missing: the base was moved, renamed or deleted. Put "
        f"{ref!r} back beside {split(path)[1]!r} (same parent folder), or load an older full checkpoint. Export "
        "self-contained copies with `shardsafe export CKPT OUT --format shardsafe` before moving checkpoints."
    )


def check_ref_files(storage: Storage, path: str, manifest: Manifest, *, committed: str = "") -> None:
    """Every referenced file exists with the size the manifest records (cheap: one stat per file).
    ``committed`` (a save about to commit): the name of its base, which was committed when the save
    began and must still be, not being deleted (no tombstone), since a delete that has begun may remove
    its files at any moment. (Older checkpoints the references reach were retired before and are kept
    by what refers to them.) Raises :class:`CheckpointNotFoundError` naming the missing or retiring
    base, or :class:`CorruptCheckpointError`."""
    for ref, entry in sorted(manifest.refs.items()):
        base = sibling(storage, path, ref)
        if ref == committed and (
            storage.exists(storage.join(base, TOMBSTONE)) or not storage.exists(storage.join(base, MANIFEST_NAME))
        ):
            raise CheckpointNotFoundError(
                f"{path}: this incremental save refers to data of its base checkpoint {ref!r}, which is being "
                "deleted (retention or a delete, maybe in another process): the save is not committed and the "
                "previous checkpoints are as they were. Save again: with a manager, the next save picks a base "
                "that is not being deleted, or pass base=None for a full save"
            )
        for name, where, size in _sizes(storage, base, entry.files):
            if size is None:
                raise missing_base(path, manifest, ref, name, where)
            if size != entry.files[name].size:
                raise CorruptCheckpointError(
                    f"{where}: {size} bytes, but {path} refers to it as {entry.files[name].size} bytes: its base "
                    f"{ref!r} was replaced or altered. Load an older checkpoint."
                )


def check_own_files(storage: Storage, path: str, manifest: Manifest) -> None:
    """Every data file the checkpoint at ``path`` lists exists with the size its manifest records
    (cheap: one stat per file; the bytes are not read). Raises :class:`CorruptCheckpointError` naming
    the file (a missing one included: the checkpoint itself is there, damaged)."""
    for name, where, size in _sizes(storage, path, manifest.files):
        if size is None:
            raise CorruptCheckpointError(f"{where}: data file missing")
        if size != manifest.files[name].size:
            raise CorruptCheckpointError(
                f"{where}: {size} bytes, the manifest says {manifest.files[name].size} (truncated or altered)"
            )


def _sizes(storage: Storage, directory: str, files: Mapping[str, FileEntry]) -> Iterator[tuple[str, str, int | None]]:
    """(name, path, size on storage or ``None`` if missing) of each of ``files`` in ``directory``,
    sorted by name: the one size check of both :func:`check_ref_files` and :func:`check_own_files`."""
    for name in sorted(files):
        where = storage.join(directory, name)
        try:
            yield name, where, storage.size(where)
        except FileNotFoundError:
            yield name, where, None


def _manifests_beside(
    storage: Storage, directory: str, tombstones: bool, ignore: str | None
) -> list[tuple[str, bytes]]:
    """(where, bytes) of every manifest under ``directory``'s parent except its own: committed
    siblings and the staged manifests of saves in flight there; with ``tombstones``, the tombstones
    of retired (or half-deleted) siblings too, except that of the sibling ``ignore``."""
    parent, own = split(directory)
    found: list[tuple[str, bytes]] = []
    for name in storage.list_dir(parent):
        if name == own:
            continue
        base = storage.join(parent, name)
        wheres = [storage.join(base, MANIFEST_NAME)]
        if PENDING_DIR.match(name):
            wheres = [storage.join(base, n) for n in STAGED_MANIFEST]
        elif tombstones and name != ignore:
            wheres.append(storage.join(base, TOMBSTONE))
        for where in wheres:
            try:
                found.append((where, storage.read_bytes(where)))
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError, CorruptCheckpointError):
                continue
    return found


def referenced_files(
    storage: Storage, directory: str, *, tombstones: bool = False, ignore: str | None = None
) -> set[str]:
    """(rank 0, before deleting data files of ``directory``) The names of its data files that another
    checkpoint under the same parent (committed, or staged by a save in flight) refers to. With
    ``tombstones``, retired siblings count too (except the sibling named ``ignore``: the one being
    deleted). A sibling manifest that does not validate is skipped with a WARNING (it is not loadable
    anyway)."""
    names = _names_of(storage, directory)
    used: set[str] = set()
    for where, raw in _manifests_beside(storage, directory, tombstones, ignore):
        try:
            manifest = parse_manifest(raw, where)
        except CorruptCheckpointError as err:
            logger.warning("shardsafe: %s does not validate; its references are not counted: %s", where, err)
            continue
        for name in names:
            ref = manifest.refs.get(name)
            if ref is not None:
                used.update(n for n in ref.files if DATA_FILE.match(n))
    return used


def _names_of(storage: Storage, directory: str) -> set[str]:
    """The names a sibling's reference may give ``directory`` by: its own, and those of symbolic links
    beside it that lead to it (``latest -> step-100``: a reference recorded by the link's name, as
    saves made before bases were resolved recorded it, reads these very files)."""
    parent, own = split(directory)
    names = {own}
    if is_remote(parent) and not parent.startswith("file://"):
        return names  # object stores have no links
    real = os.path.realpath(storage.join(parent, own).removeprefix("file://"))
    for name in storage.list_dir(parent):
        target = link_target(storage.join(parent, name)) if name != own else None
        if target is not None and target == real:
            names.add(name)
    return names


def referrers(storage: Storage, directory: str) -> dict[str, str]:
    """(any rank, local; for messages) The siblings of ``directory`` whose manifest refers to its data
    files, each with what it is: ``committed``, ``retired`` (its tombstone refers) or ``in flight`` (the
    staged manifest of a save not yet committed). Manifests that do not validate are skipped."""
    own = split(directory)[1]
    found: dict[str, str] = {}
    for where, raw in _manifests_beside(storage, directory, True, None):
        try:
            manifest = parse_manifest(raw, where)
        except CorruptCheckpointError:
            continue
        if own not in manifest.refs:
            continue
        folder, name = split(where)
        sibling_name = split(folder)[1]
        pending = PENDING_DIR.match(sibling_name)
        if pending is not None:
            found.setdefault(pending.group("target"), "in flight")
        else:
            kind = "retired" if name == TOMBSTONE else "committed"
            if found.get(sibling_name) != "committed":
                found[sibling_name] = kind
    return found
