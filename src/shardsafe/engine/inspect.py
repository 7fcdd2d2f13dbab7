"""Looking at a checkpoint without loading it: :func:`verify` (every byte against its checksum) and
:func:`inspect` (what it holds, from the manifest alone). One process, no rendezvous; both raise only
:class:`~shardsafe.errors.CheckpointError` (a damaged or hostile checkpoint: a
:class:`~shardsafe.errors.CorruptCheckpointError` naming the file and tensor)."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

from shardsafe.catalog.refs import check_ref_files, missing_base, sibling
from shardsafe.deadline import Deadline, Deadlines
from shardsafe.engine.guard import entry_point, mapped_errors
from shardsafe.engine.memory import available_memory
from shardsafe.engine.read import chunk_source, open_manifest
from shardsafe.engine.sidefiles import read_side_file, verify_side_files
from shardsafe.errors import CorruptCheckpointError, InsufficientMemoryError
from shardsafe.format import sharding
from shardsafe.format.datafile import read_blocks, verify_header
from shardsafe.format.manifest import Chunk, Manifest, TensorEntry
from shardsafe.format.values import decode, dtype_name
from shardsafe.progress.record import ProgressCallback, check_callback
from shardsafe.progress.tracker import Tracker, tracked
from shardsafe.storage import Storage, get_storage
from shardsafe.workers import run_bounded


@dataclass(frozen=True)
class VerifySummary:
    path: str
    files: int
    tensors: int
    bytes: int
    side_files: int = 0
    """Side files checked (format v3; they are checked by the part ``i == 0`` of a ``part=(i, n)`` call)."""


@dataclass(frozen=True)
class EntryInfo:
    name: str
    kind: str
    dtype: str | None
    shape: tuple[int, ...] | None
    chunks: int
    nbytes: int


@dataclass(frozen=True)
class CheckpointInfo:
    path: str
    format_version: int
    save_id: str
    created: float
    world_size: int
    strategy: str
    total_bytes: int
    metadata: Any
    files: list[str]
    entries: list[EntryInfo]
    library: dict[str, str]
    bases: list[str] = dataclasses.field(default_factory=list)
    """Sibling checkpoints this one refers to (an incremental save); empty for a self-contained one."""
    referenced_bytes: int = 0
    """Bytes of the base checkpoints' data files it refers to (not counted in ``total_bytes``)."""
    side_files: dict[str, int] = dataclasses.field(default_factory=dict)
    """Its side files (format v3), each with its size in bytes; read one with :func:`shardsafe.read_file`."""


_AS_SAVED = (
    "format_version",
    "save_id",
    "created",
    "world_size",
    "strategy",
    "total_bytes",
    "library",
    "referenced_bytes",
)
"""The fields of :class:`CheckpointInfo` that are the manifest's own, as they are."""


@entry_point("verify", reads=True)
def verify(
    path: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    part: tuple[int, int] | None = None,
    progress: ProgressCallback | None = None,
    timeout: float | Deadlines | None = None,
) -> VerifySummary:
    """Check every byte of the checkpoint at ``path`` against its checksums (one process, no rendezvous).
    Raises :class:`CheckpointNotFoundError` or :class:`CorruptCheckpointError` naming file and tensor.
    ``part=(i, n)`` checks the manifest and only the data files ``i, i + n, ...`` (in name order), so
    that ``n`` processes calling it with ``i = 0 .. n-1`` check the whole checkpoint once between them.
    An incremental checkpoint's referenced chunks are checked in its base's files (a missing base is a
    :class:`CheckpointNotFoundError` naming it). Side files are checked whole against their size and checksum
    (by part 0 of a ``part=`` split).

    ``timeout`` (seconds, or a :class:`~shardsafe.coord.Deadlines`: its ``io``) bounds the whole call, every
    read and listing included: one deadline from the call, default ``SHARDSAFE_IO_TIMEOUT`` or 1800 s (as a
    load's). Past it, :class:`CheckpointTimeoutError` naming the path (a hung disk or object store never hangs
    the caller; the stuck read is left on a daemon thread of its own).

    ``progress``: a callable given :class:`Progress` records (``op="verify"``) from a thread of its own:
    the bytes verified so far of those this call verifies (its part's files: headers, and the chunks
    the manifest lists in them; a referenced chunk once, in the base file that holds it), at least every
    ``SHARDSAFE_PROGRESS_INTERVAL`` seconds and once at the end (``error`` set if it raises). A callback
    that raises is logged and not called again; the verification goes on. Not callable: ``TypeError``
    before anything is read. See docs/progress.md."""
    progress = check_callback(progress)
    deadline = Deadline.after(Deadlines.resolve(timeout).io, "io")  # one process, no arrival: the whole call's
    path = os.fspath(path)
    with tracked("verify", path, progress, "manifest") as tracker:
        storage = get_storage(path, storage_options, deadline=deadline).within(deadline)

        def check() -> VerifySummary:
            with mapped_errors("verify", path):
                manifest = open_manifest(storage, path)
                side = manifest.side_files if part is None or part[0] == 0 else {}
                extra = sum(f.size for f in side.values())
                files, total = _verify_files(storage, path, manifest, part, tracker, extra)
                total += verify_side_files(storage, path, side, tracker.add)
            tensors = len(manifest.tensors)
            return VerifySummary(path=path, files=files, tensors=tensors, bytes=total, side_files=len(side))

        return run_bounded("verifying the checkpoint", path, deadline, check)


def _verify_files(
    storage: Storage, path: str, manifest: Manifest, part: tuple[int, int] | None, tracker: Tracker, extra: int = 0
) -> tuple[int, int]:
    """(:func:`verify`) Check the data files of ``part``: (the data files there are, the bytes checked).
    A file's ruled chunks (format v3) come from its index, read and checked with its header."""
    by_file: dict[tuple[str, str], list[tuple[str, Chunk]]] = {("", name): [] for name in manifest.files}
    for ref, r in manifest.refs.items():
        by_file.update({(ref, name): [] for name in r.files})
    for tname, entry in manifest.tensors.items():
        for c in entry.chunks:
            by_file[(c.ref or "", c.file)].append((tname, c))
    largest = max([f.size for f in manifest.files.values()] + [c.end - c.begin for _, c in _all(by_file)], default=0)
    biggest = min(largest, manifest.block_bytes)
    if biggest > available_memory():  # one checksum block is read at a time
        raise InsufficientMemoryError(
            f"verify of {path!r}: a checksum block of {biggest} bytes does not fit in the memory available "
            f"({available_memory()} bytes); checksum.block_bytes is {manifest.block_bytes}"
        )
    mine = [item for i, item in enumerate(sorted(by_file.items())) if part is None or i % part[1] == part[0]]
    entries = {key: manifest.refs[key[0]].files[key[1]] if key[0] else manifest.files[key[1]] for key, _ in mine}
    tracker.set_total(  # an own file is checked whole; of a referenced one, its header and the chunks used
        extra
        + sum(
            entries[key].size if not key[0] else entries[key].header_bytes + sum(c.end - c.begin for _, c in cs)
            for key, cs in mine
        )
    )
    tracker.phase = "read"
    source = chunk_source(storage, path, manifest)
    total = 0
    for (ref, fname), listed in mine:
        fentry = entries[(ref, fname)]
        fpath = storage.join(sibling(storage, path, ref) if ref else path, fname)
        if ref and not storage.exists(fpath):
            raise missing_base(path, manifest, ref, fname, fpath)
        try:
            chunks = listed + ([] if ref else source.in_file(fname))
            dtypes = [manifest.tensors[t].dtype for t, _ in chunks]
            verify_header(storage, fpath, fentry, [c for _, c in listed], dtypes[: len(listed)], subset=bool(ref))
            tracker.add(fentry.header_bytes)
            for tname, c in chunks:  # one block buffer per chunk, verified in place and counted
                read_blocks(storage, fpath, c, manifest.block_bytes, 0, c.end - c.begin, tname, None, tracker.count)
                total += c.end - c.begin
            if not ref and fname in source.indexes:  # read and checked whole before its ruled chunks
                index = source.indexes[fname].nbytes
                tracker.add(index)
                total += index
        except (FileNotFoundError, EOFError) as err:
            raise CorruptCheckpointError(f"{fpath}: {type(err).__name__}: {err}") from err
        total += fentry.header_bytes
    return len(by_file), total


def _all(by_file: dict[tuple[str, str], list[tuple[str, Chunk]]]) -> list[tuple[str, Chunk]]:
    return [item for items in by_file.values() for item in items]


def count_boxes(manifest: Manifest, entry: TensorEntry) -> int:
    """The chunks a ruled tensor has (its rule's non-empty boxes), from the manifest alone."""
    assert entry.sharding is not None
    return sharding.count_boxes(entry.shape, entry.sharding, manifest.meshes[entry.sharding.mesh])


@entry_point("inspect", reads=True)
def inspect(
    path: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    timeout: float | Deadlines | None = None,
) -> CheckpointInfo:
    """What a committed checkpoint holds, from its manifest (no data read); for an incremental one, the
    base checkpoints it refers to, whose files must be there (a missing base is a
    :class:`CheckpointNotFoundError` naming it). ``timeout``: as :func:`verify`'s, one deadline for the
    whole call (default ``SHARDSAFE_IO_TIMEOUT``): past it, :class:`CheckpointTimeoutError` naming the path."""
    path = os.fspath(path)
    deadline = Deadline.after(Deadlines.resolve(timeout).io, "io")
    storage = get_storage(path, storage_options, deadline=deadline).within(deadline)

    def read() -> CheckpointInfo:
        with mapped_errors("inspect", path):
            manifest = open_manifest(storage, path)
            check_ref_files(storage, path, manifest)
            entries = [EntryInfo(key, obj["kind"], None, None, 0, 0) for key, obj in manifest.objects.items()]
            for name, t in manifest.tensors.items():
                count = len(t.chunks) if t.sharding is None else count_boxes(manifest, t)
                entries.append(
                    EntryInfo(
                        name, "tensor", dtype_name(t.dtype), t.shape, count, math.prod(t.shape) * t.dtype.itemsize
                    )
                )
            metadata = decode(manifest.metadata, f"{path}: metadata", lambda ref: ref)
        copied = {name: getattr(manifest, name) for name in _AS_SAVED}
        return CheckpointInfo(
            path=path,
            metadata=metadata,
            files=sorted(manifest.files),
            entries=entries,
            bases=sorted(manifest.refs),
            side_files={name: f.size for name, f in sorted(manifest.side_files.items())},
            **copied,
        )

    return run_bounded("inspecting the checkpoint", path, deadline, read)


@entry_point("read_file", reads=True)
def read_file(
    path: str | os.PathLike[str],
    name: str,
    *,
    storage_options: dict[str, Any] | None = None,
    timeout: float | Deadlines | None = None,
) -> bytes:
    """The bytes of side file ``name`` of the committed checkpoint at ``path`` (one process, no rendezvous),
    checked against the size and checksum its manifest records: :class:`MissingKeysError` (a ``KeyError``)
    when it lists no such side file (the message lists those it has), :class:`CorruptCheckpointError` for a
    missing, resized or altered file, :class:`CheckpointNotFoundError` when nothing is committed there.
    ``timeout``: as :func:`verify`'s, one deadline for the whole call (default ``SHARDSAFE_IO_TIMEOUT``)."""
    path = os.fspath(path)
    deadline = Deadline.after(Deadlines.resolve(timeout).io, "io")
    storage = get_storage(path, storage_options, deadline=deadline).within(deadline)

    def read() -> bytes:
        with mapped_errors("read_file", path):
            manifest = open_manifest(storage, path)
            return read_side_file(storage, path, manifest.side_files, name)

    return run_bounded("reading a side file", path, deadline, read)
