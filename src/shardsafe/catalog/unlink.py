"""The gate every delete of shardsafe passes, on every backend (:func:`delete_files`): only names
shardsafe writes, each a plain name inside the directory given and a regular file there (never a
folder, a symbolic link, a FIFO or a socket, whatever its name), never inside a directory that is a
symbolic link, then an fsync of that directory.
Where the names come from (a validated manifest, a save id) is :mod:`shardsafe.catalog.delete`'s
business; this module sits below the format so that the backends' writers can discard their own file
through the same gate."""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable

from shardsafe.catalog.names import PENDING_DIR, basename, is_own, link_target
from shardsafe.format.names import side_file_problem
from shardsafe.storage.base import Storage

logger = logging.getLogger(__name__)


def delete_files(storage: Storage, directory: str, names: Iterable[str], *, side: Collection[str] = ()) -> list[str]:
    """Remove ``names`` from ``directory`` (missing ones are fine), then fsync ``directory``; returns
    the names asked for. ``side``: side file names (format v3) that the caller took from a validated manifest
    of this directory or from the save that wrote them, shardsafe's there too when they are side file names.
    Raises ``ValueError`` without removing anything if one of them is not a name shardsafe writes there, or
    if ``directory`` is a symbolic link; ``OSError`` if a removal fails. An entry that is not a regular
    file stays, with a WARNING."""
    todo = sorted(set(names))
    target = link_target(directory)
    if target is not None and todo:
        raise ValueError(
            f"refusing to delete {todo[:5]} in {directory}: it is a symbolic link to {target}, and shardsafe deletes "
            "nothing through a link"
        )
    in_pending = PENDING_DIR.match(basename(directory)) is not None
    foreign = [
        n for n in todo if not is_own(n, in_pending=in_pending) and not (n in side and side_file_problem(n) is None)
    ]
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
