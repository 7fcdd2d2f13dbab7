"""Local POSIX storage: the fast path. Data files go into a hidden pending directory beside the target
(``<parent>/.<name>.staging-<saveid>``), are fsynced, and the commit is one atomic rename:

- new target (absent, or an empty folder): ``MANIFEST.json`` is written durably inside pending, then
  the pending directory is renamed to the target;
- a target that holds a committed checkpoint (overwrite) or only what a crashed save or delete left:
  the new data files (unique names) are moved into it, then the staged manifest is renamed over the
  old one. The old checkpoint stays whole and loadable until that rename.

Either way ``<target>/MANIFEST.json`` exists iff the checkpoint is committed. Folders this backend
creates are fsynced into their parents; the blocking writes, fsyncs and renames of a save run under
its deadline (:mod:`shardsafe.workers`). Deletions go through :mod:`shardsafe.catalog.delete`.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from typing import TypeVar

from shardsafe import knobs
from shardsafe.coord.faults import fault_point
from shardsafe.deadline import NEVER, Deadline
from shardsafe.storage import regular
from shardsafe.storage.base import MANIFEST_NAME, Commit, missing_files
from shardsafe.workers import Lane, run_bounded

T = TypeVar("T")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)`` that also makes every folder it creates durable: each
    new folder's entry is fsynced into its parent (a crash must not lose the path to a committed
    checkpoint)."""
    missing = []
    head = os.path.abspath(path)
    while not os.path.isdir(head):
        missing.append(head)
        parent = os.path.dirname(head)
        if parent == head:
            break
        head = parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder)
        except FileExistsError:
            if not os.path.isdir(folder):
                raise
            continue  # made meanwhile by someone else, who makes it durable
        fsync_dir(os.path.dirname(folder))


def _write_all(fd: int, data: memoryview) -> None:
    while len(data):
        n = os.write(fd, data)
        data = data[n:]


class LocalWriter:
    """A new file written with ``os.write`` and made durable with ``fsync`` on close, every call on
    a :class:`~shardsafe.workers.Lane` of its own, waited for until the save's ``deadline``. Pieces
    under ``SMALL`` bytes (:func:`~shardsafe.knobs.local_gather_below_bytes`) are gathered (copied)
    into one buffer of up to ``GATHER`` bytes and written together: a state of thousands of small
    tensors costs a few hand-offs to the worker, not one per tensor."""

    def __init__(self, path: str, deadline: Deadline | None = None) -> None:
        self.path = path
        self.SMALL = knobs.local_gather_below_bytes()
        self.GATHER = knobs.local_gather_bytes()
        self.deadline = deadline or NEVER
        self.lane = Lane("write")
        self.gathered = bytearray()
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            self.fd = self._io("create", lambda: os.open(path, flags, 0o644))
        except BaseException:
            self.lane.close()
            raise

    def _io(self, what: str, fn: Callable[[], T]) -> T:
        return self.lane.call(what, self.path, fn, self.deadline)

    def write(self, data: memoryview) -> None:
        if len(data) < self.SMALL:
            self.gathered += data
            if len(self.gathered) >= self.GATHER:
                self._flush()
            return
        self._flush()
        fd = self.fd
        self._io("write", lambda: _write_all(fd, data))

    def _flush(self) -> None:
        if self.gathered:
            fd, data = self.fd, memoryview(self.gathered)
            self._io("write", lambda: _write_all(fd, data))
            self.gathered = bytearray()

    def close(self) -> None:
        fd = self.fd

        def sync() -> None:
            fault_point("save.fsync")
            os.fsync(fd)

        try:
            self._flush()
            self._io("fsync", sync)
        finally:
            try:
                if not self.lane.wedged:
                    self._io("close", lambda: os.close(fd))
            finally:
                self.lane.close()

    def abort(self) -> None:
        """Close and remove the file: the one this writer created (``O_EXCL``), nothing else."""
        fd, path = self.fd, self.path
        try:
            if not self.lane.wedged:
                self._io("close", lambda: os.close(fd))
                self._io("remove", lambda: _unlink(path))
        finally:
            self.lane.close()


def _kind(entry: os.DirEntry[str]) -> str:
    """The kind of a directory entry (:meth:`Storage.entries`), symbolic links never followed."""
    if entry.is_symlink():
        return "link"
    if entry.is_dir(follow_symlinks=False):
        return "dir"
    return "file" if entry.is_file(follow_symlinks=False) else "other"


def unlink_regular(directory: str, names: list[str]) -> list[str]:
    """Remove the regular files ``names`` in ``directory`` (missing ones are fine); returns those
    left in place because they are something else (a folder, a link, a FIFO, a socket)."""
    kept = []
    for name in names:
        path = os.path.join(directory, name)
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(mode):
            kept.append(name)
            continue
        _unlink(path)
    return kept


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class LocalStorage:
    """:class:`~shardsafe.storage.base.Storage` on a local (or POSIX network) filesystem."""

    def __init__(self, deadline: Deadline | None = None) -> None:
        self._deadline = deadline

    @property
    def deadline(self) -> Deadline | None:
        return self._deadline

    def within(self, deadline: Deadline | None) -> LocalStorage:
        return LocalStorage(deadline)

    def join(self, base: str, name: str) -> str:
        return os.path.join(base, name)

    def pending_dir(self, target: str, save_id: str) -> str:
        parent, name = os.path.split(os.path.abspath(target))
        return os.path.join(parent, f".{name}.staging-{save_id}")

    def prepare_pending(self, pending: str, marker: str = "") -> None:
        """Create the pending directory (beside the target: it is the mark of the save in flight, so
        ``marker`` is not written)."""

        def make() -> None:
            make_dirs(os.path.dirname(pending))
            os.mkdir(pending)
            fsync_dir(os.path.dirname(pending))

        run_bounded("creating the pending directory", pending, self.deadline or NEVER, make)

    def open_writer(self, path: str) -> LocalWriter:
        return LocalWriter(path, self.deadline)

    def stage_manifest(self, commit: Commit) -> None:
        pending = commit.pending
        staged = os.path.join(pending, MANIFEST_NAME)
        tmp = staged + ".tmp"

        def write() -> None:
            try:
                f = open(tmp, "xb")  # noqa: SIM115  (closed by the with below; the open's own error told apart)
            except FileNotFoundError:
                if os.path.isdir(pending):
                    raise
                raise missing_files(pending, sorted(commit.data_files)) from None  # the whole pending directory
            with f:
                f.write(commit.manifest)
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, staged)
            fsync_dir(pending)

        run_bounded("writing the staged manifest", staged, self.deadline or NEVER, write)

    def publish(self, commit: Commit, *, overwrite: bool, at_commit: Callable[[], None]) -> bytes | None:
        pending, target = commit.pending, commit.target
        parent = os.path.dirname(os.path.abspath(target))
        committed = os.path.join(target, MANIFEST_NAME)
        try:
            staged = os.listdir(pending)
        except FileNotFoundError:
            staged = []
        missing = sorted(commit.data_files.difference(staged))
        if missing:  # removed meanwhile: never commit a manifest that names them
            raise missing_files(pending, missing)
        if not os.path.lexists(target) or (os.path.isdir(target) and not os.listdir(target)):
            at_commit()
            os.rename(pending, target)  # the commit point (an empty folder is replaced atomically)
            fsync_dir(parent)
            return None
        if not os.path.isdir(target):
            raise NotADirectoryError(errno.ENOTDIR, "the target is not a directory", target)
        old = _read_or_none(committed)
        if old is not None and not overwrite:
            raise FileExistsError(errno.EEXIST, "a checkpoint was committed there meanwhile", committed)
        for name in staged:
            if name in commit.data_files:
                os.rename(os.path.join(pending, name), os.path.join(target, name))
        fsync_dir(target)
        at_commit()
        os.rename(os.path.join(pending, MANIFEST_NAME), committed)  # the commit point
        fsync_dir(target)
        try:
            os.rmdir(pending)  # emptied by the moves
            fsync_dir(parent)
        except OSError:  # not empty: left for discard/cleanup, which remove only shardsafe's names
            pass
        return old

    def read_bytes(self, path: str, limit: int | None = None) -> bytes:
        """The content of a regular file inside its directory, at most ``limit`` bytes (default
        ``SHARDSAFE_MAX_MANIFEST_BYTES``); anything else raises :class:`CorruptCheckpointError`."""
        return regular.read_whole(
            path, knobs.max_manifest_bytes() if limit is None else limit, "SHARDSAFE_MAX_MANIFEST_BYTES"
        )

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        if not 0 <= offset <= offset + len(out) < 2**63:
            raise EOFError(f"{path}: byte range at {offset} of {len(out)} bytes lies past any file's end")
        fd = regular.open_regular(path)
        try:
            done = 0
            while done < len(out):
                n = os.preadv(fd, [out[done:]], offset + done)
                if n == 0:
                    raise EOFError(f"{path}: ends before byte {offset + len(out)} (truncated)")
                done += n
        finally:
            os.close(fd)

    def size(self, path: str) -> int:
        return regular.stat_regular(path).st_size

    def total_size(self, path: str) -> int:
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

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(path)

    def list_dir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def entries(self, path: str) -> dict[str, str]:
        try:
            with os.scandir(path) as it:
                return {e.name: _kind(e) for e in it}
        except (FileNotFoundError, NotADirectoryError):
            return {}

    def stamp(self, path: str) -> float:
        def make() -> float:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                return os.fstat(fd).st_mtime
            finally:
                os.close(fd)

        return run_bounded("reading the storage's clock", path, self.deadline or NEVER, make)

    # -- primitives of shardsafe.catalog.delete ---------------------------------------------------

    def unlink_names(self, directory: str, names: list[str]) -> list[str]:
        return unlink_regular(directory, names)

    def sync_dir(self, directory: str) -> None:
        fsync_dir(directory)

    def retire_manifest(self, path: str, tombstone: str) -> None:
        os.rename(os.path.join(path, MANIFEST_NAME), os.path.join(path, tombstone))

    def remove_dir_if_empty(self, path: str) -> bool:
        try:
            os.rmdir(path)
        except FileNotFoundError:
            return True
        except OSError as err:
            if err.errno in (errno.ENOTEMPTY, errno.EEXIST):
                return False
            raise
        fsync_dir(os.path.dirname(os.path.abspath(path)))
        return True

    def cancel_uploads(self, target: str, save_id: str) -> None:
        return None


def _read_or_none(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None
