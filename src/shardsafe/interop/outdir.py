"""Where an export is written: a new directory that appears whole or not at all, through the one
publication transaction (:class:`~shardsafe.catalog.publish.FolderPublication`: write hidden, verify,
publish, retire).

Files are written into a hidden folder beside the target (``<parent>/.<name>.export-<hex>``), fsynced,
listed in a marker (``.shardsafe-export.json``), and the folder is renamed into place. A crash at any
instant leaves the target as it was (absent, empty, or the previous export) plus at most a hidden
folder: never a half-written export under the target's name.

The target must be absent, an empty directory, or a previous export (a directory holding exactly the
files its marker lists; replaced only with ``overwrite``). Anything else is refused untouched, and so is
a target under a regular file (:func:`make_parents`). Deleting goes through the catalog's gate and is
limited to the files this export wrote or a previous export's marker lists, and to the empty folders it
created above the target, when the export fails.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from typing import Any

from shardsafe.catalog import unlink
from shardsafe.catalog.names import EXPORT_MARKER, plain_name
from shardsafe.catalog.publish import FolderPublication
from shardsafe.errors import CheckpointExistsError, InvalidArgumentError
from shardsafe.storage import LocalStorage, is_remote

logger = logging.getLogger(__name__)

MARKER = EXPORT_MARKER
"""Lists the files of an export, so a later export can recognise (and replace) it and nothing else."""
MARKER_FORMAT = "shardsafe-export"
_MARKER_MAX = 1 << 20


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
    """Remove the folders :func:`make_parents` created, innermost first, each only if empty (through the
    catalog's gate)."""
    local = LocalStorage()
    for folder in reversed(created):
        try:
            if not unlink.remove_folder(local, folder):
                logger.warning("shardsafe export: the folder %s it created is no longer empty; left", folder)
                return
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
        self.publication = FolderPublication(self.target, replaces=self.replaces, parents=make_parents)
        self.publication.hide()
        self.pending = self.publication.hidden

    @property
    def written(self) -> list[str]:
        return list(self.publication.written)

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
        try:
            return self.publication.create(name)
        except ValueError:
            raise InvalidArgumentError(f"export file name {name!r} is not a new plain name") from None

    def write_file(self, name: str, data: bytes) -> None:
        """A small file (index, config), written whole and fsynced."""
        fd = self.create(name)
        try:
            write_all(fd, memoryview(data))
            os.fsync(fd)
        finally:
            os.close(fd)

    def publish(self, about: dict[str, Any]) -> None:
        """Verify what was written and write the marker listing it, rename the hidden folder into place
        (setting the previous export, if any, aside), then remove the previous export by the names its
        marker lists."""
        marker = {"format": MARKER_FORMAT, "version": 1, "files": sorted(self.publication.written), **about}
        self.publication.verify(json.dumps(marker, indent=1).encode())
        self.publication.publish(lambda: previous_export(self.target))
        self.publication.retire()

    def abort(self) -> None:
        """Remove what this export wrote (its hidden folder, the folders it created), nothing else."""
        self.publication.abandon()


def _some(names: list[str]) -> str:
    return ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")


def write_all(fd: int, data: memoryview) -> None:
    while len(data):
        n = os.write(fd, data)
        data = data[n:]
