"""Local POSIX storage: the fast path. Data files go into a hidden staging directory beside the target
(``<parent>/.<name>.staging-<saveid>``), are fsynced, and the commit is one atomic rename:

- new target: ``MANIFEST.json`` is written durably inside staging, then staging is renamed to the
  target (a path without a manifest, e.g. the litter of a crashed save, is moved aside first);
- overwrite: the new data files (unique names) are moved into the target, then the staged manifest
  is renamed over the old one. The old checkpoint stays whole and loadable until that rename.

Either way ``<target>/MANIFEST.json`` exists iff the checkpoint is committed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid

from shardsafe import knobs
from shardsafe.storage import regular
from shardsafe.storage.base import MANIFEST_NAME

logger = logging.getLogger(__name__)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalWriter:
    """A new file written with ``os.write`` and made durable with ``fsync`` on close."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)

    def write(self, data: memoryview) -> None:
        while len(data):
            n = os.write(self.fd, data)
            data = data[n:]

    def close(self) -> None:
        try:
            os.fsync(self.fd)
        finally:
            os.close(self.fd)

    def abort(self) -> None:
        try:
            os.close(self.fd)
        finally:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class LocalStorage:
    """:class:`~shardsafe.storage.base.Storage` on a local (or POSIX network) filesystem."""

    def join(self, base: str, name: str) -> str:
        return os.path.join(base, name)

    def staging_dir(self, target: str, save_id: str) -> str:
        parent, name = os.path.split(os.path.abspath(target))
        return os.path.join(parent, f".{name}.staging-{save_id}")

    def prepare_staging(self, staging: str) -> None:
        os.makedirs(os.path.dirname(staging), exist_ok=True)
        os.mkdir(staging)

    def open_writer(self, path: str) -> LocalWriter:
        return LocalWriter(path)

    def publish(self, staging: str, target: str, manifest: bytes, *, overwrite: bool) -> list[str]:
        staged = os.path.join(staging, MANIFEST_NAME)
        tmp = staged + ".tmp"
        with open(tmp, "wb") as f:
            f.write(manifest)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, staged)
        fsync_dir(staging)
        parent = os.path.dirname(os.path.abspath(target))
        committed = os.path.join(target, MANIFEST_NAME)
        if not os.path.exists(committed):
            if os.path.lexists(target):  # litter of a crashed save or an empty directory: not a checkpoint
                aside = os.path.join(parent, f".{os.path.basename(target)}.litter-{uuid.uuid4().hex[:8]}")
                os.rename(target, aside)
                shutil.rmtree(aside, ignore_errors=True)
            os.rename(staging, target)
            fsync_dir(parent)
            return []
        if not overwrite:
            raise FileExistsError(committed)
        old = _manifest_files(committed)
        new = [n for n in os.listdir(staging) if n != MANIFEST_NAME]
        for name in new:
            os.rename(os.path.join(staging, name), os.path.join(target, name))
        fsync_dir(target)
        os.rename(staged, committed)  # the commit point of an overwrite
        fsync_dir(target)
        shutil.rmtree(staging, ignore_errors=True)
        keep = set(new)
        return [n for n in old if n not in keep]

    def discard_staging(self, staging: str, target: str, save_id: str) -> None:
        committed = os.path.join(target, MANIFEST_NAME)
        if os.path.exists(committed) and _manifest_save_id(committed) == save_id:
            return  # the commit happened after all; its files are referenced
        for _ in range(3):  # a rank may still be creating its file while the tree is removed
            shutil.rmtree(staging, ignore_errors=True)
            if not os.path.lexists(staging):
                break
            time.sleep(0.1)
        if os.path.isdir(target):  # files an interrupted overwrite had already moved in
            self.remove_files(target, [n for n in os.listdir(target) if save_id in n and n != MANIFEST_NAME])

    def remove_files(self, directory: str, names: list[str]) -> None:
        for name in names:
            try:
                os.unlink(os.path.join(directory, name))
            except FileNotFoundError:
                pass

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

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def list_dir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []


def _manifest_doc(path: str) -> dict[str, object]:
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read())
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}


def _manifest_files(path: str) -> list[str]:
    files = _manifest_doc(path).get("files")
    return [str(n) for n in files] if isinstance(files, dict) else []


def _manifest_save_id(path: str) -> str | None:
    value = _manifest_doc(path).get("save_id")
    return str(value) if value is not None else None
