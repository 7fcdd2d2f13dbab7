"""Side files (format v3): files of their own names in a checkpoint's folder (``trainer_state.json``, a
hook's ``data.json``), committed with the checkpoint, listed in its manifest with their size and xxh3-64
checksum, verified whenever they are read, deleted with it by those validated names (docs/format.md,
section 3b; docs/huggingface.md).

Who writes what:

- (every rank, at the call) :func:`check_files`: ``files=`` names and bytes are checked, and ``write_files=``
  is callable; a misuse raises at once, before any rank waits.
- (rank 0, after its data file) :class:`SideWriter`: writes the ``files=`` it was given, then calls
  ``write_files(folder)`` with a fresh local folder of its own and copies every file the callback left there
  into the checkpoint; each file is hashed while it is written (:class:`~shardsafe.storage.base.Writer`,
  under the save's deadline), and the names it wrote are kept so that an aborted save removes them.
- (every other rank) :func:`digests`: the size and checksum of its own ``files=``, sent in its write
  report; rank 0 refuses the save (:func:`merge`) when one differs from its own or names a file rank 0 did not
  give: one checkpoint cannot hold two versions of a name.
- (any reader) :func:`read_side_file` and :func:`verify_side_files`: the bytes against the manifest.
- (code that writes files by path before a save, e.g. Accelerate's save-state hooks) :func:`side_files_folder`
  (public: ``shardsafe.side_files_folder``): a fresh local folder, removed on exit through the delete gate.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import xxhash

from shardsafe.catalog import unlink
from shardsafe.errors import CorruptCheckpointError, InvalidArgumentError, InvalidTypeError, MissingKeysError
from shardsafe.format.model import SideFile
from shardsafe.format.names import side_file_problem
from shardsafe.storage import Storage

logger = logging.getLogger(__name__)

PIECE = 8 * 2**20
"""Bytes a side file is copied and verified in at a time."""

WriteFiles = Callable[[str], None]
"""``write_files(folder)``: writes side files into ``folder`` (a local folder of plain files, no sub-folders)."""


def check_files(files: Mapping[str, Any] | None, write_files: Any, call: str) -> dict[str, bytes]:
    """(every rank, at the call) ``files=`` as a dict of checked names to bytes (copied: the caller may change
    its buffers once the call returns); raises :class:`InvalidArgumentError` naming a bad name,
    :class:`InvalidTypeError` for bytes that are not bytes or a ``write_files`` that is not callable."""
    if write_files is not None and not callable(write_files):
        raise InvalidTypeError(f"{call}(write_files=...) takes a callable write_files(folder), not {write_files!r}")
    if files is None:
        return {}
    if not isinstance(files, Mapping):
        raise InvalidTypeError(f"{call}(files=...) takes a dict of name -> bytes, not {type(files).__name__}")
    out: dict[str, bytes] = {}
    for name, data in files.items():
        problem = side_file_problem(name)
        if problem is not None:
            raise InvalidArgumentError(f"{call}(files=...): {problem}")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidTypeError(
                f"{call}(files={{{name!r}: ...}}) takes bytes, not {type(data).__name__}; encode text first "
                "(json.dumps(...).encode())"
            )
        out[name] = bytes(data)
    return out


def digests(files: Mapping[str, bytes]) -> dict[str, list[Any]]:
    """(ranks other than 0) ``{name: [size, xxh3-64]}`` of the ``files=`` this rank gave, for rank 0 to compare."""
    return {name: [len(data), xxhash.xxh3_64_hexdigest(data)] for name, data in sorted(files.items())}


class SideWriter:
    """(rank 0) Writes one save's side files into its pending directory ``pending`` (the target itself on
    object stores). ``written`` holds every name it created, for the removal of an aborted save's files."""

    def __init__(self, storage: Storage, pending: str, path: str, after_each: Callable[[], None]) -> None:
        """``after_each``: called after each file is durable (the fault point ``save.side_files``)."""
        self.after_each = after_each
        self.storage = storage
        self.pending = pending
        self.path = path
        self.written: list[str] = []
        self.entries: dict[str, list[Any]] = {}

    def write(self, files: Mapping[str, bytes], write_files: WriteFiles | None) -> dict[str, list[Any]]:
        """Write ``files``, then what ``write_files`` leaves in its folder; returns ``{name: [size, xxh3-64]}``."""
        for name, data in files.items():
            self._write_one(name, lambda emit, data=data: emit(memoryview(data)))  # type: ignore[misc]
        if write_files is not None:
            self._from_callback(write_files, set(files))
        return dict(sorted(self.entries.items()))

    def _write_one(self, name: str, produce: Callable[[Callable[[memoryview], None]], None]) -> None:
        where = self.storage.join(self.pending, name)
        writer = self.storage.open_writer(where)
        self.written.append(name)  # created (empty): an abort removes it
        h = xxhash.xxh3_64()
        size = 0

        def emit(piece: memoryview) -> None:
            nonlocal size
            h.update(piece)
            size += len(piece)
            writer.write(piece)

        try:
            produce(emit)
        except BaseException:
            writer.abort()
            raise
        writer.close()
        self.entries[name] = [size, h.hexdigest()]
        self.after_each()

    def _from_callback(self, write_files: WriteFiles, given: set[str]) -> None:
        """Call ``write_files`` with a fresh local folder, then copy each plain file it left there into the
        checkpoint (hashing as it writes), removing it from the folder; the folder goes at the end."""
        with side_files_folder() as scratch:
            write_files(scratch)
            with os.scandir(scratch) as it:
                names = sorted(e.name for e in it)
            for name in names:
                source = os.path.join(scratch, name)
                mode = os.lstat(source).st_mode
                problem = side_file_problem(name)
                if not stat.S_ISREG(mode):
                    problem = f"{name!r} is not a plain file (a folder or a link); side files are plain files only"
                elif problem is None and name in given:
                    problem = f"{name!r} is given both in files= and by write_files"
                if problem is not None:
                    raise InvalidArgumentError(f"save of {self.path!r}: write_files wrote {problem}")
                self._write_one(name, lambda emit, source=source: _copy(source, emit))  # type: ignore[misc]
                unlink.remove_scratch(scratch, [name])  # its copy is in the checkpoint: free the space now


def _copy(source: str, emit: Callable[[memoryview], None]) -> None:
    with open(source, "rb") as f:
        while piece := f.read(PIECE):
            emit(memoryview(piece))


@contextlib.contextmanager
def side_files_folder() -> Iterator[str]:
    """``with shardsafe.side_files_folder() as folder:`` a fresh local folder of this process's own
    (``shardsafe-side-files-<random>`` in the temporary directory), for files that code writes by path before
    a save takes them as side files (``files=`` with their bytes, or ``write_files=`` copying them in). On exit
    it is removed through the delete gate: the plain files and symbolic links left in it (a link itself, never
    what it points to), then the folder; a sub-folder keeps it, and a folder that was replaced by a symbolic
    link is left, each with a WARNING naming it (nothing is removed recursively, nor through a link)."""
    folder = tempfile.mkdtemp(prefix="shardsafe-side-files-")
    try:
        yield folder
    finally:
        _remove_scratch(folder)


def _remove_scratch(scratch: str) -> None:
    """Remove a :func:`side_files_folder` through the catalog's gate (:func:`~shardsafe.catalog.unlink.remove_scratch`:
    the plain files and links left in it, then the folder; a sub-folder keeps it, logged, since nothing is
    removed recursively; a folder that is now a symbolic link is left, logged: nothing is removed through one)."""
    try:
        unlink.remove_scratch(scratch)
    except (OSError, ValueError) as err:
        logger.warning(
            "shardsafe: could not remove the side files' temporary folder %s: %s; remove it by hand", scratch, err
        )


def merge(reports: Mapping[int, Mapping[str, list[Any]]], path: str) -> dict[str, SideFile]:
    """(rank 0, every report in) The checkpoint's side files: rank 0's; raises :class:`InvalidArgumentError`
    when another rank gave a name rank 0 did not write, or other bytes under one (naming both)."""
    mine = reports.get(0, {})
    for rank in sorted(r for r in reports if r != 0):
        for name, (size, checksum) in sorted(reports[rank].items()):
            if name not in mine:
                raise InvalidArgumentError(
                    f"save of {path!r}: rank {rank} gave the side file {name!r} and rank 0 did not; side files are "
                    "written by rank 0, so give it there too (the same bytes), or only there"
                )
            if [size, checksum] != list(mine[name]):
                raise InvalidArgumentError(
                    f"save of {path!r}: rank {rank} gave other bytes for the side file {name!r} than rank 0 ({size} "
                    f"bytes, xxh3-64 {checksum}; rank 0: {mine[name][0]} bytes, {mine[name][1]}); a checkpoint holds "
                    "one version of each name: give the same bytes on every rank, or give it on rank 0 only"
                )
    return {name: SideFile(int(size), str(checksum)) for name, (size, checksum) in sorted(mine.items())}


def _check_listed(manifest_side: Mapping[str, SideFile], name: str, path: str) -> SideFile:
    if name not in manifest_side:
        listed = ", ".join(sorted(manifest_side)) or "none"
        message = f"{path} has no side file {name!r}; its side files: {listed}"
        raise MissingKeysError(message, [name], sorted(manifest_side))
    return manifest_side[name]


def read_side_file(storage: Storage, path: str, side: Mapping[str, SideFile], name: str) -> bytes:
    """(any rank, local) The bytes of side file ``name`` of the checkpoint at ``path`` whose manifest lists
    ``side``, checked against its size and checksum: :class:`MissingKeysError` when it lists no such name,
    :class:`CorruptCheckpointError` for a missing, resized or altered file."""
    entry = _check_listed(side, name, path)
    where = storage.join(path, name)
    try:
        size = storage.size(where)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: side file missing") from None
    if size != entry.size:
        raise CorruptCheckpointError(f"{where}: {size} bytes, the manifest says {entry.size} (truncated or altered)")
    from shardsafe.engine.memory import available_memory

    if entry.size > available_memory():
        raise CorruptCheckpointError(
            f"{where}: side file of {entry.size} bytes does not fit in the memory available ({available_memory()})"
        )
    out = bytearray(entry.size)
    if entry.size:
        storage.read_into(where, 0, memoryview(out))
    if xxhash.xxh3_64_hexdigest(out) != entry.checksum:
        raise CorruptCheckpointError(f"{where}: side file fails its checksum (altered or damaged)")
    return bytes(out)


def verify_side_files(
    storage: Storage, path: str, side: Mapping[str, SideFile], count: Callable[[int], None] | None = None
) -> int:
    """(one process) Check every side file of the checkpoint at ``path`` (its size, then every byte against
    its checksum, :data:`PIECE` bytes at a time); returns the bytes checked."""
    total = 0
    buf = bytearray(PIECE)
    for name, entry in sorted(side.items()):
        where = storage.join(path, name)
        try:
            size = storage.size(where)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{where}: side file missing") from None
        if size != entry.size:
            raise CorruptCheckpointError(
                f"{where}: {size} bytes, the manifest says {entry.size} (truncated or altered)"
            )
        h = xxhash.xxh3_64()
        done = 0
        while done < entry.size:
            n = min(PIECE, entry.size - done)
            view = memoryview(buf)[:n]
            storage.read_into(where, done, view)
            h.update(view)
            done += n
            if count is not None:
                count(n)
        if h.hexdigest() != entry.checksum:
            raise CorruptCheckpointError(f"{where}: side file fails its checksum (altered or damaged)")
        total += entry.size
    return total
