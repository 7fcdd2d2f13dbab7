"""The gate every delete of shardsafe passes, on every backend: files (:func:`remove`), folders
(:func:`remove_folder`), shardsafe's own temporary folders (:func:`remove_scratch`), the local tier's
emptied step and entry folders (:func:`remove_tier_folder`) and a failed transfer's folder
(:func:`remove_transfer`), and a symbolic link itself (:func:`remove_link`). Only names
shardsafe writes (:mod:`shardsafe.catalog.names`), each a plain name inside the directory given and a
regular file there (never a folder, a symbolic link, a FIFO or a socket, whatever its name), never
inside a directory that is a symbolic link, then an fsync of that directory; a folder only when it is
empty. Nothing is removed through a symbolic link, and nothing recursively.

Where the names come from (a validated manifest, a save id, an export's marker) is the caller's
business: :mod:`shardsafe.catalog.delete` for checkpoints, :mod:`shardsafe.catalog.publish` for what a
publication wrote or replaced. :func:`shardsafe.catalog.delete.delete_files` is the one entry for a
checkpoint's files (it keeps what a sibling refers to, then calls :func:`remove`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Iterable

from shardsafe.catalog.names import (
    PENDING_DIR,
    SCRATCH_DIR,
    TIER_INCOMING,
    TIER_STEP,
    basename,
    is_export_folder,
    is_own,
    is_tier_entry,
    link_target,
    plain_name,
    transfer_file,
)
from shardsafe.format.names import side_file_problem
from shardsafe.storage.base import Storage
from shardsafe.storage.local import LocalStorage

logger = logging.getLogger(__name__)


def _refuse_link(directory: str, what: object) -> None:
    target = link_target(directory)
    if target is not None:
        raise ValueError(
            f"refusing to delete {what} in {directory}: it is a symbolic link to {target}, and shardsafe deletes "
            "nothing through a link"
        )


def remove(
    storage: Storage,
    directory: str,
    names: Iterable[str],
    *,
    side: Collection[str] = (),
    listed: Collection[str] = (),
) -> list[str]:
    """Remove ``names`` from ``directory`` (missing ones are fine), then fsync ``directory``; returns
    the names asked for. ``side``: side file names (format v3) that the caller took from a validated
    manifest of this directory or from the save that wrote them; ``listed``: the plain names of an
    export's files, from its validated marker or from the export that wrote them (in an export's hidden
    or set-aside folder only). Raises ``ValueError`` without removing anything if one of them is not a
    name shardsafe writes there, or if ``directory`` is a symbolic link; ``OSError`` if a removal fails.
    An entry that is not a regular file stays, with a WARNING."""
    todo = sorted(set(names))
    if todo:
        _refuse_link(directory, todo[:5])
    in_pending = (
        PENDING_DIR.match(basename(directory)) is not None or TIER_INCOMING.match(basename(directory)) is not None
    )
    in_export = is_export_folder(directory)

    def ours(n: str) -> bool:
        if is_own(n, in_pending=in_pending, in_export=in_export):
            return True
        if n in side and side_file_problem(n) is None:
            return True
        return in_export and n in listed and plain_name(n)

    foreign = [n for n in todo if not ours(n)]
    if foreign:
        raise ValueError(
            f"refusing to delete {foreign} in {directory}: shardsafe deletes only the files it writes "
            "(data-<rank>-<saveid>.safetensors and its own manifest files)"
        )
    if todo:
        kept = storage.unlink_names(directory, todo) or []
        storage.sync_dir(directory)
        if kept:
            logger.warning(
                "shardsafe: left %s in %s: not regular files (a folder, a symbolic link, a FIFO or a socket), which "
                "shardsafe never writes, so never removes",
                kept,
                directory,
            )
    return todo


def remove_folder(storage: Storage, path: str) -> bool:
    """Remove the folder ``path`` if it is empty (then fsync its parent); whether it is gone. Never a
    folder that is a symbolic link (``ValueError``), never what is inside one."""
    _refuse_link(path, "the folder")
    return storage.remove_dir_if_empty(path)


def remove_tier_folder(path: str) -> bool:
    """(one process, the local tier) Remove the folder ``path`` if it is empty (then fsync its parent);
    whether it is gone. Only a name the local tier writes in a node folder: a step folder
    (:data:`~shardsafe.catalog.names.TIER_STEP`) or an entry of one (a share, a replica, a transfer, a pending
    directory); never a folder that is a symbolic link or inside one. ``ValueError``, removing nothing,
    otherwise."""
    name = basename(path)
    if TIER_STEP.match(name) is None and not is_tier_entry(name):
        raise ValueError(f"refusing to remove the folder {path}: not a name the local tier writes")
    _refuse_link(os.path.dirname(os.path.abspath(path)), "the folder")
    _refuse_link(path, "the folder")
    return LocalStorage().remove_dir_if_empty(path)


def remove_transfer(folder: str, names: Iterable[str]) -> bool:
    """(one process, the local tier) Remove a failed transfer's hidden folder ``folder``
    (:data:`~shardsafe.catalog.names.TIER_INCOMING`): the files ``names`` it wrote there (a copy's manifest,
    data files, the manifest's temporary name), then the folder if that empties it; whether it is gone.
    ``ValueError``, removing nothing, for a folder of another name, a folder that is a symbolic link or is
    inside one, or a name a transfer does not write."""
    if TIER_INCOMING.match(basename(folder)) is None:
        raise ValueError(f"refusing to clear {folder}: not a transfer's folder of the local tier")
    todo = sorted(set(names))
    foreign = [n for n in todo if not (transfer_file(n) or is_own(n))]
    if foreign:
        raise ValueError(f"refusing to delete {foreign} in {folder}: not the files of a local-tier copy")
    _refuse_link(os.path.dirname(os.path.abspath(folder)), "the transfer's folder")
    _refuse_link(folder, "the transfer's folder")
    local = LocalStorage()
    remove(local, folder, todo)
    return local.remove_dir_if_empty(folder)


def remove_scratch(folder: str, names: Iterable[str] | None = None) -> bool:
    """(one process) Remove the entries ``names`` (default: every entry) of ``folder``, a temporary
    folder shardsafe made (:data:`~shardsafe.catalog.names.SCRATCH_DIR`), then the folder when that
    empties it; whether it is gone (with ``names``: True). Regular files go, and symbolic links as links
    (never what they point to); a sub-folder stays, and keeps the folder (logged): nothing is removed
    recursively. ``ValueError`` for a folder of any other name."""
    if SCRATCH_DIR.match(basename(folder)) is None:
        raise ValueError(f"refusing to clear {folder}: not a temporary folder shardsafe made")
    _refuse_link(folder, "the temporary folder")
    every = names is None
    with os.scandir(folder) as it:
        entries = {e.name: e for e in it}
    for name in sorted(entries if names is None else set(names) & set(entries)):
        e = entries[name]
        if e.is_symlink() or e.is_file(follow_symlinks=False):
            os.unlink(e.path)  # a link itself, or a file: both written there by the callback
        else:
            logger.warning("shardsafe: %s in the temporary folder %s is not a plain file; left", name, folder)
    if not every:
        return True
    gone = LocalStorage().remove_dir_if_empty(folder)
    if not gone:
        logger.warning("shardsafe: the temporary folder %s holds folders; left", folder)
    return gone


def remove_link(path: str) -> None:
    """(one process: a local path that is a symbolic link, which the caller checked leads to a
    checkpoint of shardsafe or to nothing) Remove the link itself, never what it leads to; then fsync its
    folder."""
    if not os.path.islink(path):
        raise ValueError(f"{path} is not a symbolic link")
    os.unlink(path)
    LocalStorage().sync_dir(os.path.dirname(os.path.abspath(path)))
