"""The narrow storage interface the engine talks to. Paths are ``str``; the engine never imports
``os.path`` or fsspec. Two backends: :mod:`shardsafe.storage.local` (POSIX fast path: a pending
directory, fsync, rename) and a remote one over fsspec (object stores: unique data names, manifest
last in one PUT).

Commit rule shared by both: a checkpoint is committed iff ``<target>/MANIFEST.json`` exists, and that
file appears in one atomic step after every data file it names is durable. Data files are never
overwritten (their names carry the save id).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from shardsafe.deadline import Deadline

MANIFEST_NAME = "MANIFEST.json"


@dataclass(frozen=True)
class Commit:
    """One save's manifest on its way to ``<target>/MANIFEST.json``: where its data files are staged
    (``pending``: :meth:`Storage.pending_dir`), the checkpoint's path, the save id its data file names
    carry, the manifest's bytes, the names of the data files it writes (``data_files``; a backend moves
    those and nothing else) and the name of its temporary manifest where one is renamed into place
    (``temp_manifest``). The names come from :mod:`shardsafe.catalog.names`
    (:func:`~shardsafe.catalog.names.commit_of`): a backend never derives one."""

    pending: str
    target: str
    save_id: str
    manifest: bytes
    data_files: frozenset[str]
    temp_manifest: str


class Writer(Protocol):
    """A data file being written. ``write`` appends; ``close`` makes it durable (fsync / upload done);
    ``abort`` discards it: it removes the file this writer created and nothing else (its name came from
    :mod:`shardsafe.catalog.names`; every other delete goes through :mod:`shardsafe.catalog.delete`).
    Exactly one of ``close``/``abort`` is called."""

    def write(self, data: memoryview) -> None: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...


class Storage(Protocol):
    """What the engine and the manager need from a filesystem or object store, the same for every
    backend (:func:`shardsafe.storage.get_storage` picks one). Deletions go through
    :mod:`shardsafe.catalog.delete` only, which calls the primitives at the end of this class."""

    def join(self, base: str, name: str) -> str:
        """``base`` + ``/`` + a plain ``name``."""
        ...

    def set_deadline(self, deadline: Deadline | None) -> None:
        """Bound the blocking local writes, fsyncs and renames of the save path, and every request to
        an object store, made from now on (writers opened later included) by ``deadline``: past it they
        raise :class:`~shardsafe.errors.CheckpointTimeoutError` (a ``TimeoutError``) instead of hanging.
        ``None``: unbounded."""
        ...

    def pending_dir(self, target: str, save_id: str) -> str:
        """(rank 0 and writers) Where a save's data files go before commit. Local: a hidden sibling
        directory of ``target``; object stores: ``target`` itself (unique names make that safe)."""
        ...

    def prepare_pending(self, pending: str) -> None:
        """(rank 0, before writers start) Create the pending directory (and durably, its parents)."""
        ...

    def open_writer(self, path: str) -> Writer:
        """(writing ranks) Create a new file; fail if it exists."""
        ...

    def stage_manifest(self, commit: Commit) -> None:
        """(rank 0, before deciding to commit) Make the manifest durable where :meth:`publish` takes it
        from, without making it visible at the target."""
        ...

    def publish(self, commit: Commit, *, overwrite: bool, at_commit: Callable[[], None]) -> bytes | None:
        """(rank 0, after it won the "commit" decision) Commit: make the staged manifest visible at
        the target in one atomic step, after the data files. ``at_commit()`` is called right before
        that step and may raise to prevent it. Returns the bytes of the manifest it replaced (for
        the removal of old data files), or ``None``."""
        ...

    def read_bytes(self, path: str, limit: int | None = None) -> bytes:
        """The whole content of a (small) file of at most ``limit`` bytes (default
        ``SHARDSAFE_MAX_MANIFEST_BYTES``). Raises ``FileNotFoundError``, and
        :class:`~shardsafe.errors.CorruptCheckpointError` for a larger file or for something that is
        not a regular file (a FIFO, a device, a directory, a symlink loop, a symlink out of its
        directory): the read side never blocks on, or streams from, what a checkpoint should not hold."""
        ...

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes at ``[offset, offset + len(out))``; raise ``EOFError`` if the file
        is shorter. Opens only regular files, as :meth:`read_bytes` does."""
        ...

    def size(self, path: str) -> int:
        """Size in bytes of a regular file (as :meth:`read_bytes`). Raises ``FileNotFoundError``."""
        ...

    def total_size(self, path: str) -> int:
        """Bytes of a file, or of the files directly inside a directory (the manager's listing).
        Raises ``FileNotFoundError``."""
        ...

    def mtime(self, path: str) -> float:
        """Last change (unix time) of ``path`` or of anything directly inside it: how long ago a save
        last touched a pending directory (the manager's cleanup). Raises ``FileNotFoundError``."""
        ...

    def exists(self, path: str) -> bool: ...

    def is_dir(self, path: str) -> bool:
        """Whether ``path`` is a directory (an object-store prefix holding something)."""
        ...

    def list_dir(self, path: str) -> list[str]:
        """Names (not paths) directly inside ``path``; empty when it does not exist."""
        ...

    # Primitives of :mod:`shardsafe.catalog.delete`; nothing else calls them.

    def unlink_names(self, directory: str, names: list[str]) -> None:
        """Remove the files ``names`` (plain names) in ``directory``; missing ones are fine."""
        ...

    def sync_dir(self, directory: str) -> None:
        """Make ``directory``'s entries durable (fsync; nothing on object stores)."""
        ...

    def retire_manifest(self, path: str, tombstone: str) -> None:
        """Uncommit the checkpoint at ``path`` in one atomic step, keeping its manifest under the name
        ``tombstone`` beside it (object stores: the tombstone is written before the manifest goes)."""
        ...

    def remove_dir_if_empty(self, path: str) -> bool:
        """Remove the directory ``path`` if it is empty (then fsync its parent); whether it is gone."""
        ...

    def cancel_uploads(self, target: str, save_id: str) -> None:
        """Abort unfinished uploads of save ``save_id`` under ``target`` (object stores)."""
        ...
