"""Storage backends behind one interface, :class:`~shardsafe.storage.base.Storage`, the same shape
for the local POSIX backend (``local``) and the fsspec one (``remote``, ``uploads``, ``retry``,
``fsspec_util``); it covers what the engine needs (pending, writers, publish, ranged reads) and what
the manager needs (listing, sizes, ages), and the primitives the delete rule of
:mod:`shardsafe.catalog.delete` calls. It knows no file name but ``MANIFEST.json``: a
:class:`~shardsafe.storage.base.Commit` names the files a publish moves. Also: regular-file checks
(``regular``); blocking calls under a deadline run on :mod:`shardsafe.workers`.

Layer: may import coord (fault points), workers, deadline, knobs and errors. Imported by format and
everything above."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardsafe.deadline import Deadline
from shardsafe.errors import InvalidTypeError
from shardsafe.storage.base import MANIFEST_NAME, Commit, Storage, Writer
from shardsafe.storage.local import LocalStorage

__all__ = ["MANIFEST_NAME", "Commit", "LocalStorage", "Storage", "Writer", "get_storage", "is_remote"]


def is_remote(path: str) -> bool:
    """A path with a scheme (``s3://``, ``memory://``, ``file://``...) goes through fsspec."""
    return "://" in str(path)


def get_storage(
    path: str, storage_options: dict[str, Any] | None = None, *, deadline: Deadline | None = None
) -> Storage:
    """The backend for ``path``: local POSIX for plain paths, fsspec for paths with a scheme.
    ``storage_options`` (a dict) are the fsspec filesystem's options; a plain path accepts and ignores
    them, as frameworks pass theirs whatever the path. ``deadline``: the call's: it bounds every blocking
    step of the storage returned (a step with a nearer one gets its own view,
    :meth:`~shardsafe.storage.base.Storage.within`), and its length bounds an object store client's own
    timeouts and retries."""
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise InvalidTypeError(f"storage_options must be a dict of fsspec options or None, not {storage_options!r}")
    if is_remote(path):
        from shardsafe.storage.remote import FsspecStorage

        return FsspecStorage.for_path(path, storage_options, deadline=deadline)  # type: ignore[no-any-return]
    return LocalStorage(deadline)
