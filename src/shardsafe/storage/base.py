"""The narrow storage interface the engine talks to. Paths are ``str``; the engine never imports
``os.path`` or fsspec. Two backends: :mod:`shardsafe.storage.local` (POSIX fast path: a pending
directory, fsync, rename) and a remote one over fsspec (object stores: unique data names, manifest
last in one PUT).

Commit rule shared by both: a checkpoint is committed iff ``<target>/MANIFEST.json`` exists, and that
file appears in one atomic step after every data file it names is durable. Data files are never
overwritten (their names carry the save id).
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from shardsafe.deadline import Deadline

MANIFEST_NAME = "MANIFEST.json"


class PublishRefusedError(OSError):
    """Raised by :meth:`Storage.publish` when the storage definitely did not make the manifest visible
    and never will: it answered every attempt of the request with a refusal (an HTTP 4xx or 501 of an
    object store), so nothing of it can land later. The original error is its cause. It stays here, an
    ``OSError`` and no :class:`~shardsafe.errors.CheckpointError`, on purpose: the storage interface speaks
    like ``os``, and the commit turns it into a :class:`~shardsafe.errors.CommitFailedError`; it never
    reaches a caller."""


def missing_files(where: str, missing: list[str]) -> FileNotFoundError:
    """The error of a publish that found data files of its save gone from ``where`` (raised before the
    commit point: nothing is committed)."""
    shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    return FileNotFoundError(
        errno.ENOENT,
        f"{len(missing)} data file(s) of this save are no longer in {where} ({shown}), so its manifest is not "
        "committed: something removed them while the save ran, most likely another process's sweep of leftovers "
        "(a save there that commits, or a CheckpointManager's cleanup) because this save took longer than the "
        "leftover age (SHARDSAFE_LEFTOVER_AGE_SECONDS, a manager's leftover_age); raise it above the longest save",
        where,
    )


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

    @property
    def deadline(self) -> Deadline | None:
        """What bounds every blocking step of this storage object (``None``: nothing)."""
        ...

    def within(self, deadline: Deadline | None) -> Storage:
        """The same storage, with its blocking local writes, fsyncs and renames and every request to an
        object store (writers it opens included) bounded by ``deadline``: past it they raise
        :class:`~shardsafe.errors.CheckpointTimeoutError` (a ``TimeoutError``) instead of hanging. A new
        object: a deadline is handed to each call that needs one, never set on a shared storage
        (``None``: unbounded)."""
        ...

    def pending_dir(self, target: str, save_id: str) -> str:
        """(rank 0 and writers) Where a save's data files go before commit. Local: a hidden sibling
        directory of ``target``; object stores: ``target`` itself (unique names make that safe)."""
        ...

    def prepare_pending(self, pending: str, marker: str = "") -> None:
        """(rank 0, before writers start) Create the pending directory (and durably, its parents).
        Where the pending directory is the target itself (URL storage: data files go straight in),
        also write the empty file ``marker`` there (a plain name from :mod:`shardsafe.catalog.names`),
        the sign that a save is in flight that the sweep of leftovers respects; on S3, with
        ``If-None-Match: *``, and the store's conditional writes are checked once per process and
        bucket (:mod:`shardsafe.storage.conditional`)."""
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
        the target in one atomic step, after the data files. First it checks, with one listing (no
        byte is read), that every one of ``commit.data_files`` is there: a file another process
        removed meanwhile raises ``FileNotFoundError`` naming it, and nothing is committed.
        ``at_commit()`` is called right before that step and may raise to prevent it. Returns the
        bytes of the manifest it replaced (for the removal of old data files), or ``None``. Raises
        :class:`PublishRefusedError` when the storage surely refused the commit step."""
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

    def entries(self, path: str) -> dict[str, str]:
        """What :meth:`list_dir` lists, each with its kind, from the same listing: ``"file"`` (a regular
        file; an object), ``"dir"`` (a folder; a prefix), ``"link"`` (a symbolic link, never
        followed) or ``"other"`` (a FIFO, a socket, a device)."""
        ...

    def stamp(self, path: str) -> float:
        """Create the empty file ``path`` (it must not exist) and return its modification time as the
        storage records it: the storage's own clock, which the sweep of leftovers compares other
        modification times with (never the host's). The caller removes it (through the gate)."""
        ...

    # Primitives of :mod:`shardsafe.catalog.delete`; nothing else calls them.

    def unlink_names(self, directory: str, names: list[str]) -> list[str]:
        """Remove the regular files ``names`` (plain names) in ``directory``; missing ones are fine.
        Returns the names left in place because they are not regular files (a folder, a symbolic link,
        a FIFO, a socket: shardsafe writes none of these, and removes none)."""
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
