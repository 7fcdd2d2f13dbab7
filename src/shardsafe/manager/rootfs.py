"""The few filesystem operations the manager needs to look at its root (list, age, size), behind one
small interface chosen in one place (:func:`open_root`), instead of ``os`` calls scattered through
the manager. Remote roots use the fsspec storage backend, which implements the same operations.
Deleting is not among them: every delete goes through :mod:`shardsafe.storage.delete`."""

from __future__ import annotations

import os
from typing import Protocol

from shardsafe.storage import is_remote


class RootFS(Protocol):
    """Listing and deletion under a checkpoint root. Paths are ``str``."""

    def join(self, base: str, name: str) -> str:
        """``base`` + separator + a plain ``name``."""
        ...

    def list_dir(self, path: str) -> list[str]:
        """Names directly inside ``path``, sorted; empty when it does not exist."""
        ...

    def is_dir(self, path: str) -> bool: ...

    def exists(self, path: str) -> bool: ...

    def mtime(self, path: str) -> float:
        """Last change (unix time) of ``path`` or of anything directly inside it: how long ago a save
        last touched a staging directory. Raises ``FileNotFoundError``."""
        ...

    def size(self, path: str) -> int:
        """Bytes of a file, or of the files directly inside a directory."""
        ...


class LocalRootFS:
    """:class:`RootFS` on a local (or POSIX network) filesystem."""

    def join(self, base: str, name: str) -> str:
        return os.path.join(base, name)

    def list_dir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(path)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def mtime(self, path: str) -> float:
        newest = os.stat(path).st_mtime
        if os.path.isdir(path):
            with os.scandir(path) as it:
                for entry in it:
                    try:
                        newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
                    except FileNotFoundError:  # removed while we looked: it no longer counts
                        continue
        return newest

    def size(self, path: str) -> int:
        if not os.path.isdir(path):
            return os.stat(path).st_size
        total = 0
        with os.scandir(path) as it:
            for entry in it:
                try:
                    if entry.is_file(follow_symlinks=False):
                        total += entry.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    continue
        return total


def open_root(root: str) -> RootFS:
    """The :class:`RootFS` for ``root``: the local filesystem for a plain path, the fsspec storage
    backend (which provides these operations too) for a URL such as ``s3://bucket/run``."""
    if is_remote(root):
        from shardsafe.storage.remote import FsspecStorage  # fsspec is imported only for remote roots

        return FsspecStorage.for_path(root)
    return LocalRootFS()
