"""The narrow storage interface the engine talks to. Paths are ``str``; the engine never imports
``os.path`` or fsspec. Two backends: :mod:`shardsafe.storage.local` (POSIX fast path: staging
directory, fsync, rename) and a remote one over fsspec (object stores: unique data names, manifest
last in one PUT).

Commit rule shared by both: a checkpoint is committed iff ``<target>/MANIFEST.json`` exists, and that
file appears in one atomic step after every data file it names is durable. Data files are never
overwritten (their names carry the save id).
"""

from __future__ import annotations

from typing import Protocol

MANIFEST_NAME = "MANIFEST.json"


class Writer(Protocol):
    """A data file being written. ``write`` appends; ``close`` makes it durable (fsync / upload done);
    ``abort`` discards it. Exactly one of ``close``/``abort`` is called."""

    def write(self, data: memoryview) -> None: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...


class Storage(Protocol):
    """What the engine needs from a filesystem or object store."""

    def join(self, base: str, name: str) -> str:
        """``base`` + ``/`` + a plain ``name``."""
        ...

    def staging_dir(self, target: str, save_id: str) -> str:
        """(rank 0 and writers) Where a save's data files go before commit. Local: a hidden sibling
        directory of ``target``; object stores: ``target`` itself (unique names make that safe)."""
        ...

    def prepare_staging(self, staging: str) -> None:
        """(rank 0, before writers start) Create the staging location."""
        ...

    def open_writer(self, path: str) -> Writer:
        """(writing ranks) Create a new file; fail if it exists."""
        ...

    def publish(self, staging: str, target: str, manifest: bytes, *, overwrite: bool) -> list[str]:
        """(rank 0) Commit: make ``manifest`` visible at ``target`` in one atomic step, after the data
        files in ``staging``. Returns the names of files in ``target`` from an older checkpoint that
        the new manifest no longer references (for :meth:`remove_files`)."""
        ...

    def discard_staging(self, staging: str, target: str, save_id: str) -> None:
        """(every rank, on abort; idempotent) Remove what save ``save_id`` wrote; never touches the
        files of a committed manifest, nor anything if that save turns out to have committed."""
        ...

    def remove_files(self, directory: str, names: list[str]) -> None:
        """Delete ``names`` in ``directory``; missing ones are fine."""
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

    def exists(self, path: str) -> bool: ...

    def list_dir(self, path: str) -> list[str]:
        """Names (not paths) directly inside ``path``; empty when it does not exist."""
        ...
