"""The gate every delete of shardsafe passes, on every backend (:func:`delete_files`): only names
shardsafe writes, each a plain name inside the directory given, then an fsync of that directory.
Where the names come from (a validated manifest, a save id) is :mod:`shardsafe.catalog.delete`'s
business; this module sits below the format so that the backends' writers can discard their own file
through the same gate."""

from __future__ import annotations

from collections.abc import Collection, Iterable

from shardsafe.catalog.names import PENDING_DIR, basename, is_own
from shardsafe.format.names import side_file_problem
from shardsafe.storage.base import Storage


def delete_files(storage: Storage, directory: str, names: Iterable[str], *, side: Collection[str] = ()) -> list[str]:
    """Remove ``names`` from ``directory`` (missing ones are fine), then fsync ``directory``; returns
    the names asked for. ``side``: side file names (format v3) that the caller took from a validated manifest
    of this directory or from the save that wrote them, shardsafe's there too when they are side file names.
    Raises ``ValueError`` without removing anything if one of them is not a name shardsafe writes there,
    ``OSError`` if a removal fails."""
    todo = sorted(set(names))
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
        storage.unlink_names(directory, todo)
        storage.sync_dir(directory)
    return todo
