"""One publication transaction for everything shardsafe writes: **write hidden, verify, publish,
retire** (or, on failure, **abandon**). Every writer goes through it: a save (sync, async, incremental,
a local tier's share, its side files), the shardsafe-format export (a checkpoint too), the Hugging Face
export (a folder), the torch export (a file). Every name is the catalog's (:mod:`shardsafe.catalog.names`),
and every removal passes the gate (:mod:`shardsafe.catalog.unlink`, through
:func:`shardsafe.catalog.delete.delete_files` for a checkpoint's files): nothing through a symbolic link,
nothing recursively.

- :class:`CheckpointPublication`: a checkpoint on any :class:`~shardsafe.storage.base.Storage`. Hidden:
  its pending directory (and, on URL storage, the in-flight marker: the sweep of leftovers keeps a save
  in flight). Verify: the manifest's bytes pass the loader's own parser, then are staged durably.
  Publish: :meth:`Storage.publish <shardsafe.storage.base.Storage.publish>` (its listing checks every
  data file is there; one atomic step). Retire: the replaced checkpoint's files the new manifest does
  not list, its side files, the marker, then what only it referred to in siblings. Abandon: every name
  the save could have written (:func:`~shardsafe.catalog.delete.discard_save`).
- :class:`FolderPublication`: a new local folder (an export). Hidden: ``.<name>.export-<id>`` beside the
  target. Verify: every file written is there with its size; the marker listing them, then the folder,
  durable. Publish: one rename (a previous export, recognised by its marker, is set aside as
  ``.<name>.replaced-<id>`` first and put back if the rename fails). Retire: the set-aside export's
  listed files, its marker, its folder.
- :class:`CopyPublication`: a copy of a local-tier share received from another rank (a replica, or a
  share fetched at resume), into its step folder. Hidden: ``.incoming-<entry>-<pid>-<id>`` there, each file
  created new (never through a link), the manifest under a temporary name until it is whole. Verify: the
  caller's (every byte against the manifest's checksums, its metadata). Publish: one rename to the entry's
  name, the step folder durable. Abandon: the files it wrote, then its folder (the gate's
  :func:`~shardsafe.catalog.unlink.remove_transfer`).
- :class:`FilePublication`: a new local file (an export). Hidden: ``.<name>.export-<id>.tmp``. Verify:
  durable (fsync). Publish: a hard link to the target's name, which fails if the name appeared (a
  rename, after a check, where there are no hard links). Retire: the hidden name.

Each method takes the deadline of its step: the storage is bounded per call
(:meth:`Storage.within <shardsafe.storage.base.Storage.within>`), never through shared state."""

from __future__ import annotations

import errno
import logging
import os
import stat
import uuid
from collections.abc import Callable, Collection, Iterable
from typing import BinaryIO

from shardsafe.catalog import unlink
from shardsafe.catalog.delete import (
    delete_files,
    discard_save,
    release_references,
    stale_files,
    stale_side_files,
)
from shardsafe.catalog.names import (
    EXPORT_MARKER,
    TIER_REPLICA,
    TIER_SHARE,
    commit_of,
    export_hidden,
    export_replaced,
    export_temp,
    in_flight_marker,
    link_target,
    plain_name,
    temp_manifest,
    tier_incoming,
    transfer_file,
)
from shardsafe.deadline import Deadline
from shardsafe.errors import (
    CheckpointExistsError,
    CorruptCheckpointError,
    InternalError,
    LocalTierError,
    UnsafePathError,
)
from shardsafe.format.manifest import parse_manifest
from shardsafe.storage import MANIFEST_NAME, Commit, LocalStorage, Storage
from shardsafe.storage.local import fsync_dir
from shardsafe.workers import run_bounded

logger = logging.getLogger(__name__)

__all__ = ["CheckpointPublication", "CopyPublication", "FilePublication", "FolderPublication"]


# ---------------------------------------------------------------------------------- checkpoints


class CheckpointPublication:
    """(rank 0 of a save, or one process) One checkpoint on its way to ``target``; see the module
    docstring. ``pending`` is where every writer puts its data files (rank 0's choice, which the other
    ranks are given)."""

    def __init__(self, storage: Storage, target: str, save_id: str, *, pending: str | None = None) -> None:
        self.storage = storage
        self.target = target
        self.save_id = save_id
        self.pending = storage.pending_dir(target, save_id) if pending is None else pending
        self.where = storage.join(target, MANIFEST_NAME)

    def hide(self, deadline: Deadline) -> None:
        """(rank 0, before any writer) Create the pending directory; where data files go straight into
        the target (URL storage), write the in-flight marker there first."""
        self.storage.within(deadline).prepare_pending(self.pending, in_flight_marker(self.save_id))

    def verify(self, manifest: bytes, files: Iterable[str], deadline: Deadline) -> Commit:
        """(rank 0, every data file durable) Check ``manifest`` with the loader's own parser (raises
        :class:`CorruptCheckpointError`: never publish what a loader would refuse), then stage it
        durably in the pending directory; the :class:`Commit` to publish. ``files``: the data and side
        files it lists."""
        parse_manifest(manifest, self.where)
        commit = commit_of(self.pending, self.target, self.save_id, manifest, files)
        self.storage.within(deadline).stage_manifest(commit)
        return commit

    def publish(
        self, commit: Commit, *, overwrite: bool, at_commit: Callable[[], None], deadline: Deadline
    ) -> bytes | None:
        """(rank 0, the decision to publish taken) The atomic step; the manifest it replaced, if any
        (see :meth:`Storage.publish <shardsafe.storage.base.Storage.publish>`)."""
        return self.storage.within(deadline).publish(commit, overwrite=overwrite, at_commit=at_commit)

    def retire(self, old: bytes | None, new: bytes, deadline: Deadline) -> list[str]:
        """(rank 0, committed) Remove the replaced checkpoint's data and side files the new manifest
        ``new`` does not list (names from the old manifest ``old``, validated), the in-flight marker, then
        what only ``old`` referred to in siblings; the data files removed."""
        storage = self.storage.within(deadline)
        stale = stale_files(old, new, self.where)
        marker = [in_flight_marker(self.save_id)] if self.pending == self.target else []
        stale_side = stale_side_files(old, new, self.where)

        def remove() -> None:
            delete_files(storage, self.target, [*stale, *marker])
            if stale_side:
                delete_files(storage, self.target, stale_side, side=stale_side)
            release_references(storage, self.target, old, self.where)

        run_bounded("removing the old data files", self.target, deadline, remove)
        return stale

    def abandon(self, world_size: int, deadline: Deadline, *, side: tuple[str, ...] = ()) -> None:
        """(every rank, once the save is aborted; idempotent) Remove what the save wrote, within
        ``deadline`` (a hung disk must not hang the error path). Raises what the removal raised."""
        storage = self.storage.within(deadline)
        run_bounded(
            "removing the files of the failed save",
            self.pending,
            deadline,
            lambda: discard_save(storage, self.pending, self.target, self.save_id, world_size, side),
        )

    def committed(self, deadline: Deadline) -> bool:
        """(any rank) Whether the manifest at the target validates and carries this save id: the probe
        of a rank that lost the publisher."""
        try:
            raw = self.storage.within(deadline).read_bytes(self.where)
            return parse_manifest(raw, self.where).save_id == self.save_id
        except (OSError, CorruptCheckpointError):
            return False


# ---------------------------------------------------------------------------------- local folders


def _unique() -> str:
    return uuid.uuid4().hex[:12]


class FolderPublication:
    """(one process) A new local folder at ``target``, written hidden beside it; see the module
    docstring. ``replaces``: the files of the previous export there (from its validated marker), which
    :meth:`publish` sets aside and :meth:`retire` removes; ``None``: the target is absent or empty."""

    def __init__(self, target: str, *, replaces: list[str] | None, parents: Callable[[str], list[str]]) -> None:
        self.target = os.path.abspath(target)
        self.parent, self.name = os.path.split(self.target)
        self.replaces = replaces
        self.hidden = os.path.join(self.parent, export_hidden(self.name, _unique()))
        self.aside: str | None = None
        self.written: dict[str, int] = {}
        self.created: list[str] = []
        self._parents = parents
        self._local = LocalStorage()

    def hide(self) -> None:
        """Create the folders above the target (``parents``, which refuses a target under a file) and
        the hidden folder."""
        self.created = self._parents(self.parent)
        try:
            os.mkdir(self.hidden)
        except BaseException:
            self._remove_created()
            raise

    def create(self, name: str) -> int:
        """A new file ``name`` (a plain name) in the hidden folder, open for writing (the caller fsyncs
        and closes it)."""
        if not plain_name(name) or name in self.written or name == EXPORT_MARKER:
            raise ValueError(f"export file name {name!r} is not a new plain name")
        fd = os.open(os.path.join(self.hidden, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        self.written[name] = -1
        return fd

    def verify(self, marker: bytes) -> None:
        """Every file written is in the hidden folder as a regular file (its size recorded); then the
        ``marker`` listing them, and the folder, durable."""
        for name in self.written:
            info = os.lstat(os.path.join(self.hidden, name))
            if not stat.S_ISREG(info.st_mode):
                raise OSError(errno.EINVAL, "an export's file is not a regular file", os.path.join(self.hidden, name))
            self.written[name] = info.st_size
        fd = os.open(os.path.join(self.hidden, EXPORT_MARKER), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC)
        try:
            _write_all(fd, memoryview(marker))
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(self.hidden)

    def publish(self, still_replaces: Callable[[], list[str] | None]) -> None:
        """Rename the hidden folder to the target. A target that held a previous export (checked again
        with ``still_replaces``: its files, or ``None`` when it is no longer an export) is set aside
        first, and put back if the rename fails."""
        if self.replaces is None:
            os.rename(self.hidden, self.target)  # onto an empty directory too; fails if one appeared non-empty
            fsync_dir(self.parent)
            return
        files = still_replaces()
        if files is None:
            raise CheckpointExistsError(f"{self.target} changed during the export and is no longer an export: refused")
        self.replaces = files
        aside = os.path.join(self.parent, export_replaced(self.name, _unique()))
        os.rename(self.target, aside)
        try:
            os.rename(self.hidden, self.target)
        except BaseException:
            os.rename(aside, self.target)
            raise
        self.aside = aside
        fsync_dir(self.parent)

    def retire(self) -> None:
        """Remove the export set aside by :meth:`publish`: the files its marker listed, the marker, the
        folder if that empties it (what it does not list stays, logged)."""
        if self.aside is None or self.replaces is None:
            return
        try:
            if not self._clear(self.aside, self.replaces):
                logger.warning(
                    "shardsafe export: the replaced export at %s holds files it did not list: left", self.aside
                )
        except (OSError, ValueError) as err:  # the new export is in place; what is left is hidden litter, said so
            logger.warning(
                "shardsafe export: the replaced export at %s could not be removed fully: %s", self.aside, err
            )

    def abandon(self) -> None:
        """Remove what this export wrote: its hidden folder's files and marker, the folder, the folders
        created above the target; nothing else."""
        try:
            gone = self._clear(self.hidden, list(self.written))
        except (OSError, ValueError) as err:
            logger.warning("shardsafe export: could not remove the hidden folder %s: %s", self.hidden, err)
            return
        if not gone:
            logger.warning("shardsafe export: the hidden folder %s holds files it did not write: left", self.hidden)
            return
        self._remove_created()

    def _clear(self, folder: str, files: Collection[str]) -> bool:
        """Remove ``files`` and the marker from ``folder`` (an export's hidden or set-aside folder) through
        the gate, then the folder if empty; whether it is gone."""
        unlink.remove(self._local, folder, [*files, EXPORT_MARKER], listed=files)
        return unlink.remove_folder(self._local, folder)

    def _remove_created(self) -> None:
        """Remove the folders :meth:`hide` created above the target, innermost first, each only if empty."""
        for folder in reversed(self.created):
            try:
                if not unlink.remove_folder(self._local, folder):
                    logger.warning("shardsafe export: the folder %s it created is no longer empty; left", folder)
                    return
            except OSError as err:
                logger.warning("shardsafe export: could not remove the folder %s it created: %s", folder, err)
                return


class FilePublication:
    """(one process) A new local file at ``target``, written hidden beside it; see the module docstring.
    ``created``: folders made above it for it (removed again if it is abandoned)."""

    def __init__(self, target: str, created: list[str]) -> None:
        self.target = os.path.abspath(target)
        self.parent, self.name = os.path.split(self.target)
        self.hidden = os.path.join(self.parent, export_temp(self.name, _unique()))
        self.created = created
        self._local = LocalStorage()

    def verify(self) -> None:
        """The hidden file, written by the caller, durable."""
        with open(self.hidden, "rb+") as f:
            os.fsync(f.fileno())

    def publish(self) -> None:
        """Give the hidden file the target's name only if no file has it (a hard link fails on an
        existing name; without hard links: check, then rename), then make that durable."""
        try:
            os.link(self.hidden, self.target)
        except FileExistsError:
            raise CheckpointExistsError(
                f"{self.target} appeared during the export: refused, nothing was changed"
            ) from None
        except OSError as err:
            if err.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV):
                raise
            if os.path.lexists(self.target):
                raise CheckpointExistsError(f"{self.target} appeared during the export: refused") from None
            os.rename(self.hidden, self.target)
        fsync_dir(self.parent)

    def retire(self, *, published: bool) -> None:
        """Remove the hidden name (after a publish, the target keeps the file); when not ``published``,
        also the folders created above the target, each only if empty."""
        unlink.remove(self._local, self.parent, [os.path.basename(self.hidden)])
        if published:
            return
        for folder in reversed(self.created):
            try:
                if not unlink.remove_folder(self._local, folder):
                    return
            except OSError as err:
                logger.warning("shardsafe export: could not remove the folder %s it created: %s", folder, err)
                return


# ---------------------------------------------------------------------------- local-tier copies


class CopyPublication:
    """(one process, the local tier) A copy received into the entry ``entry`` (``rank-R`` or
    ``replica-of-rank-R``) of the step folder ``where``; see the module docstring. :class:`InternalError` for
    another entry name; :class:`UnsafePathError` for a step folder that is a symbolic link (or not a folder),
    :class:`LocalTierError` for a file name a copy does not hold."""

    def __init__(self, where: str, entry: str) -> None:
        if TIER_SHARE.match(entry) is None and TIER_REPLICA.match(entry) is None:
            raise InternalError(f"{entry!r} is not an entry of a local-tier step folder (a bug: please report it)")
        if link_target(where) is not None or not os.path.isdir(where):
            raise UnsafePathError(f"{where} is a symbolic link or not a folder; nothing is written through a link")
        self.where = where
        self.final = os.path.join(where, entry)
        self.hidden = os.path.join(where, tier_incoming(entry, os.getpid(), uuid.uuid4().hex[:8]))
        self.written: list[str] = []

    def hide(self) -> None:
        """Create the hidden folder."""
        os.mkdir(self.hidden)

    def create(self, name: str) -> BinaryIO:
        """A new file ``name`` of the copy (its manifest, a data file) in the hidden folder, open for writing
        (the manifest under a temporary name until :meth:`seal`); never through a link, never an existing one."""
        if not transfer_file(name) or name in self.written:
            raise LocalTierError(
                f"a local-tier copy holds no file called {name!r} (its manifest and data files, each once)"
            )
        own = temp_manifest(uuid.uuid4().hex[:8]) if name == MANIFEST_NAME else name
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
        fd = os.open(os.path.join(self.hidden, own), flags, 0o644)
        self.written.append(own)
        return os.fdopen(fd, "wb")

    def seal(self, f: BinaryIO) -> None:
        """Make the file ``f`` of :meth:`create` durable and close it; the manifest then takes its name (whole,
        or not there)."""
        try:
            f.flush()
            os.fsync(f.fileno())
        finally:
            f.close()
        own = self.written[-1]
        if own != MANIFEST_NAME and not transfer_file(own):  # the manifest's temporary name
            os.rename(os.path.join(self.hidden, own), os.path.join(self.hidden, MANIFEST_NAME))
            self.written[-1] = MANIFEST_NAME

    def publish(self) -> str:
        """(the copy verified; the entry's name free: the caller removed a copy of its run there) Rename the
        hidden folder to the entry's name, then make the step folder durable; the entry's path."""
        if link_target(self.hidden) is not None or link_target(self.where) is not None:
            raise UnsafePathError(
                f"{self.hidden} or its folder became a symbolic link; nothing is published through it"
            )
        if os.path.lexists(self.final):
            raise CheckpointExistsError(f"{self.final} appeared during the transfer; the copy does not replace it")
        os.rename(self.hidden, self.final)
        fsync_dir(self.where)
        return self.final

    def abandon(self) -> bool:
        """Remove what the transfer wrote: its files, then its hidden folder (through the gate); whether the
        folder is gone."""
        return unlink.remove_transfer(self.hidden, self.written)


def _write_all(fd: int, data: memoryview) -> None:
    while len(data):
        n = os.write(fd, data)
        data = data[n:]
