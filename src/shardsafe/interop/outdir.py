"""Where an export is written: a new directory that appears whole or not at all.

Files are written into a hidden pending directory beside the target (``<parent>/.<name>.export-<hex>``),
fsynced, and the pending directory is renamed into place. A crash at any instant leaves the target as
it was (absent, empty, or the previous export) plus at most a hidden pending directory: never a
half-written export under the target's name.

The target must be absent, an empty directory, or a previous export (a directory holding exactly the
files its ``.shardsafe-export.json`` lists; replaced only with ``overwrite``). Anything else is
refused untouched, and so is a target under a regular file (:func:`make_parents`). Deleting is limited
to the files this module wrote or a previous export's marker lists, each name checked to be a plain name
inside the directory, and to the empty folders it created above the target, when the export fails.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import uuid
from typing import Any

from shardsafe.errors import CheckpointExistsError, InvalidArgumentError
from shardsafe.storage import is_remote
from shardsafe.storage.local import LocalStorage, fsync_dir

logger = logging.getLogger(__name__)

MARKER = ".shardsafe-export.json"
"""Lists the files of an export, so a later export can recognise (and replace) it and nothing else."""
MARKER_FORMAT = "shardsafe-export"
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,254}$")
_MARKER_MAX = 1 << 20


def plain_name(name: Any) -> bool:
    return isinstance(name, str) and bool(_NAME.match(name)) and ".." not in name


def marker_files(path: str) -> list[str] | None:
    """The files the export marker in ``path`` lists, if it is well formed (plain names only) and every
    listed file is there as a regular file; else ``None``."""
    try:
        info = os.lstat(os.path.join(path, MARKER))
        if not stat.S_ISREG(info.st_mode) or info.st_size > _MARKER_MAX:
            return None
        with open(os.path.join(path, MARKER), "rb") as f:
            doc = json.loads(f.read(_MARKER_MAX))
    except (OSError, ValueError, RecursionError):  # a marker nested too deep for json is no marker
        return None
    files = doc.get("files") if isinstance(doc, dict) and doc.get("format") == MARKER_FORMAT else None
    if not isinstance(files, list) or not all(plain_name(n) for n in files) or MARKER in files:
        return None
    for name in files:
        try:
            if not stat.S_ISREG(os.lstat(os.path.join(path, name)).st_mode):
                return None
        except OSError:
            return None
    return list(files)


def previous_export(path: str) -> list[str] | None:
    """The files of the export at ``path``, or ``None`` when ``path`` holds anything else: no valid
    marker (see :func:`marker_files`), or any entry the marker does not list."""
    files = marker_files(path)
    try:
        entries = set(os.listdir(path))
    except OSError:
        return None
    return files if files is not None and entries == {*files, MARKER} else None


def make_parents(parent: str) -> list[str]:
    """Create the folder ``parent`` and those missing above it; returns the ones created, outermost
    first (for :func:`remove_created`). Raises :class:`CheckpointExistsError` naming the nearest existing
    ancestor when it is not a folder (an export under a regular file), before creating anything."""
    missing = check_parents(parent)
    created: list[str] = []
    for folder in reversed(missing):
        try:
            os.mkdir(folder)
        except FileExistsError:
            if not os.path.isdir(folder):
                remove_created(created)
                raise CheckpointExistsError(f"{folder} appeared as a file during the export: refused") from None
            continue
        created.append(folder)
    return created


def check_parents(parent: str) -> list[str]:
    """The folders missing above and at ``parent``, outermost last; :class:`CheckpointExistsError` when
    the nearest existing one is not a folder."""
    missing: list[str] = []
    here = os.path.abspath(parent)
    while not os.path.lexists(here):
        missing.append(here)
        up = os.path.dirname(here)
        if up == here:
            break
        here = up
    if os.path.lexists(here) and not os.path.isdir(here):
        raise CheckpointExistsError(
            f"{here} is not a directory (a file is there), so nothing can be written under it: refused, nothing was "
            "changed. Export to a path inside a folder"
        )
    return missing


def remove_created(created: list[str]) -> None:
    """Remove the folders :func:`make_parents` created, innermost first, each only if empty."""
    for folder in reversed(created):
        try:
            os.rmdir(folder)
        except FileNotFoundError:
            continue
        except OSError as err:  # something else was put there meanwhile: left as it is, said so
            logger.warning("shardsafe export: could not remove the folder %s it created: %s", folder, err)
            return


def inside(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or lies under it (symlinks resolved)."""
    p, r = os.path.realpath(path), os.path.realpath(root)
    return p == r or p.startswith(r.rstrip(os.sep) + os.sep)


class ExportDir:
    """(one process) A new export of ``source`` at ``target``. Checks the target on construction
    (before anything is read or written), then: :meth:`create` files, :meth:`publish` or :meth:`abort`."""

    def __init__(self, target: str, *, source: str, overwrite: bool) -> None:
        if is_remote(target):
            raise InvalidArgumentError(
                f"export writes to a local directory, not {target!r}; export locally, then upload it"
            )
        self.target = os.path.abspath(target)
        self.parent, self.name = os.path.split(self.target)
        if not self.name:
            raise InvalidArgumentError(f"{target!r} is not a directory name an export can be written to")
        if not is_remote(source) and inside(self.target, source):
            raise InvalidArgumentError(
                f"{target} lies inside the checkpoint {source}: an export there would be mixed into the checkpoint "
                "(and removed with it). Export to a directory outside it"
            )
        self.replaces: list[str] | None = self._check(overwrite)
        self.overwrite = overwrite
        self.pending = os.path.join(self.parent, f".{self.name}.export-{uuid.uuid4().hex[:12]}")
        self.created = make_parents(self.parent)
        try:
            os.mkdir(self.pending)
        except BaseException:
            remove_created(self.created)
            raise
        self.written: list[str] = []

    def _check(self, overwrite: bool) -> list[str] | None:
        """``None`` for an absent or empty target, else the previous export's files; refuses the rest."""
        if os.path.islink(self.target):
            raise CheckpointExistsError(
                f"{self.target} is a symbolic link; export to the directory it points to, or to a new path"
            )
        if not os.path.lexists(self.target):
            return None
        if not os.path.isdir(self.target):
            raise CheckpointExistsError(f"{self.target} exists and is not a directory; export to a new path")
        entries = sorted(os.listdir(self.target))
        if not entries:
            return None
        files = marker_files(self.target)
        if files is None:
            raise CheckpointExistsError(
                f"{self.target} is not empty ({_some(entries)}) and is not a shardsafe export: refused, nothing was "
                "changed. Export into a new or empty directory"
            )
        extra = [e for e in entries if e != MARKER and e not in files]
        if extra:
            raise CheckpointExistsError(
                f"{self.target} holds a previous export plus files it did not write ({_some(extra)}): refused, "
                "nothing was changed. Move those files out, or export to a new directory"
            )
        if not overwrite:
            raise CheckpointExistsError(
                f"{self.target} holds a previous export; pass overwrite=True (--overwrite) to replace it, "
                "or export to a new directory"
            )
        return files

    def create(self, name: str) -> int:
        """A new file ``name`` in pending, open for writing (the caller closes it after :func:`os.fsync`)."""
        if not plain_name(name) or name in self.written:
            raise InvalidArgumentError(f"export file name {name!r} is not a new plain name")
        fd = os.open(os.path.join(self.pending, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        self.written.append(name)
        return fd

    def write_file(self, name: str, data: bytes) -> None:
        """A small file (index, config), written whole and fsynced."""
        fd = self.create(name)
        try:
            write_all(fd, memoryview(data))
            os.fsync(fd)
        finally:
            os.close(fd)

    def publish(self, about: dict[str, Any]) -> None:
        """Write the marker, make the pending folder durable and rename it into place (replacing the previous
        export, if any, whose files are then deleted by the names its marker lists)."""
        marker = {"format": MARKER_FORMAT, "version": 1, "files": sorted(self.written), **about}
        fd = os.open(os.path.join(self.pending, MARKER), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            write_all(fd, memoryview(json.dumps(marker, indent=1).encode()))
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(self.pending)
        if self.replaces is None:
            os.rename(self.pending, self.target)  # onto an empty directory too; fails if one appeared non-empty
            fsync_dir(self.parent)
            return
        files = previous_export(self.target)
        if files is None:
            raise CheckpointExistsError(f"{self.target} changed during the export and is no longer an export: refused")
        aside = os.path.join(self.parent, f".{self.name}.replaced-{uuid.uuid4().hex[:12]}")
        os.rename(self.target, aside)
        try:
            os.rename(self.pending, self.target)
        except BaseException:
            os.rename(aside, self.target)
            raise
        fsync_dir(self.parent)
        _remove_export(aside, files)

    def abort(self) -> None:
        """Remove what this export wrote (its pending directory, the folders it created), nothing else."""
        try:
            gone = _remove_listed(self.pending, self.written)
        except OSError as err:
            logger.warning("shardsafe export: could not remove pending directory %s: %s", self.pending, err)
            return
        if not gone:
            logger.warning("shardsafe export: pending directory %s holds files it did not write: left", self.pending)
            return
        remove_created(self.created)


def _some(names: list[str]) -> str:
    return ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")


def _remove_listed(path: str, files: list[str]) -> bool:
    """Remove ``files`` (plain names this module wrote or a marker listed) and the marker from the
    directory ``path``, then the directory if it is empty, through the local backend's delete
    primitives (the ones the catalog's delete rule calls). Whether the directory is gone."""
    names = [*(n for n in files if plain_name(n)), MARKER]
    local = LocalStorage()
    local.unlink_names(path, names)
    return local.remove_dir_if_empty(path)


def _remove_export(path: str, files: list[str]) -> None:
    """Delete a replaced export: the files its marker listed, the marker, the directory if then empty."""
    try:
        if not _remove_listed(path, files):
            logger.warning("shardsafe export: the replaced export at %s holds files it did not list: left", path)
    except OSError as err:  # the new export is in place; what is left is hidden litter, said loudly
        logger.warning("shardsafe export: the replaced export at %s could not be removed fully: %s", path, err)


def write_all(fd: int, data: memoryview) -> None:
    while len(data):
        n = os.write(fd, data)
        data = data[n:]
