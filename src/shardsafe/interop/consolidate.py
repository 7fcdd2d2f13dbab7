"""``shardsafe export CKPT OUT --format shardsafe``: a self-contained copy of a checkpoint. Every chunk
(those an incremental checkpoint takes from its bases included) is read block by block, verified, and
written into new data files of OUT, one per source file, with fresh checksums; the manifest is the
source's with no references. The copy is committed like a save: data files first, the manifest last
in one atomic step (a pending directory renamed into place locally, one PUT on object stores), through
the same publication transaction as a save (:class:`~shardsafe.catalog.publish.CheckpointPublication`:
on URL storage its in-flight marker keeps a sweep of leftovers away). One process; bounded memory (one
checksum block at a time); one deadline for the whole call (``timeout=``; by default the larger of
``SHARDSAFE_TIMEOUT`` and ``SHARDSAFE_IO_TIMEOUT``), which every read, write and the publish wait for
at most. A failure leaves nothing behind: the data files written so far, the pending directory and the
folders created above OUT are removed (only those)."""

from __future__ import annotations

import functools
import logging
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from shardsafe.catalog.names import data_file, refusal
from shardsafe.catalog.publish import CheckpointPublication
from shardsafe.catalog.refs import chunk_path, missing_base
from shardsafe.deadline import Deadline, Deadlines
from shardsafe.engine.guard import entry_point, mapped_errors
from shardsafe.engine.plan import PendingChunk, file_bytes
from shardsafe.engine.read import read_manifest
from shardsafe.errors import CheckpointError, CheckpointExistsError, CorruptCheckpointError
from shardsafe.format.datafile import read_blocks, write_file
from shardsafe.format.manifest import FORMAT_VERSION, Chunk, FileEntry, Manifest, TensorEntry
from shardsafe.interop.outdir import check_parents, make_parents, remove_created
from shardsafe.progress.record import ProgressCallback, check_callback
from shardsafe.progress.tracker import Tracker, tracked
from shardsafe.storage import get_storage, is_remote
from shardsafe.storage.base import Storage
from shardsafe.workers import Lane

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConsolidateResult:
    path: str
    tensors: int
    bytes: int
    files: list[str]
    bases: list[str]


@entry_point("export", reads=True)
def consolidate(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    progress: ProgressCallback | None = None,
    timeout: float | None = None,
) -> ConsolidateResult:
    """(one process) Write the checkpoint ``src`` as a self-contained checkpoint at ``out`` (absent or an
    empty folder). Raises :class:`CheckpointError` (a missing base: :class:`CheckpointNotFoundError`
    naming it; a corrupt block: :class:`CorruptCheckpointError`); ``out`` is untouched on failure.
    ``progress``: as for :func:`~shardsafe.interop.hf.export_hf`, counting the bytes of the new data
    files as they are written (the ``bytes`` of the result). ``timeout``: seconds for the whole copy
    (default: the larger of ``SHARDSAFE_TIMEOUT`` and ``SHARDSAFE_IO_TIMEOUT``); past it
    :class:`CheckpointTimeoutError`, with nothing left behind."""
    deadline = Deadlines.resolve(timeout).start().end
    progress = check_callback(progress)
    src, out = os.fspath(src), os.fspath(out)
    with tracked("export", src, progress, "manifest") as tracker:
        return _consolidate(src, out, storage_options, tracker, deadline)


def _consolidate(
    src: str, out: str, storage_options: dict[str, Any] | None, tracker: Tracker, deadline: Deadline
) -> ConsolidateResult:
    storage = get_storage(src, storage_options, deadline=deadline)
    dest = get_storage(out, storage_options, deadline=deadline)
    with mapped_errors("export", src):
        manifest = read_manifest(storage, src)  # every chunk listed: each is copied
    local = not is_remote(out)
    if local:
        if os.path.islink(out):
            raise CheckpointExistsError(
                f"export of {src!r}: {out} is a symbolic link; export to the folder it points to, or to a new path"
            )
        check_parents(os.path.dirname(os.path.abspath(out)))
    why = refusal(dest, out, overwrite=False)
    if why is not None:
        raise CheckpointExistsError(f"export of {src!r}: {why}")
    save_id = f"{int(time.time())}{uuid.uuid4().hex[:10]}"
    publication = CheckpointPublication(dest, out, save_id)  # write hidden, verify, publish, retire
    created = make_parents(os.path.dirname(os.path.abspath(out))) if local else []
    written: list[str] = []
    try:
        publication.hide(deadline)
        return _copy(src, out, storage, dest, manifest, publication, written, tracker, deadline)
    except BaseException:
        _discard(publication, len(written), deadline)
        remove_created(created)
        raise


def _discard(publication: CheckpointPublication, files: int, deadline: Deadline) -> None:
    """Remove what this copy wrote, as a failed save is discarded (its data files, its staged or
    temporary manifest, its marker, its pending directory; never anything else), within the grace after
    the deadline."""
    try:
        publication.abandon(files, deadline.or_grace())
    except (OSError, ValueError, CheckpointError) as err:
        logger.warning("shardsafe export: could not remove the pending directory %s: %s", publication.pending, err)


def _copy(
    src: str,
    out: str,
    storage: Storage,
    dest: Storage,
    manifest: Manifest,
    publication: CheckpointPublication,
    written: list[str],
    tracker: Tracker,
    deadline: Deadline,
) -> ConsolidateResult:
    save_id, pending = publication.save_id, publication.pending
    reads = Lane("export-read")  # every read waited for until the deadline, on a daemon thread
    groups: dict[tuple[str, str], list[tuple[str, Chunk]]] = {}
    for name, t in manifest.tensors.items():
        for c in t.chunks:
            groups.setdefault((c.ref or "", c.file), []).append((name, c))
    files: dict[str, FileEntry] = {}
    new_chunks: dict[str, list[Chunk]] = {}
    plans = []
    for _, members in sorted(groups.items()):
        chunks = [PendingChunk(n, c.offsets, c.sizes, _meta(manifest, n, c)) for n, c in members]
        plans.append((members, chunks, file_bytes(chunks, manifest.block_bytes)))
    tracker.set_total(sum(size for _, _, (size, _) in plans))
    tracker.phase = "write"
    try:
        for i, (members, chunks, (_, header)) in enumerate(plans):
            fname = data_file(i, save_id)
            windows = tracker.counted(_bytes(storage, src, manifest, members, reads, deadline), header)
            written.append(fname)
            writer = dest.open_writer(dest.join(pending, fname))
            try:
                entry, records = write_file(writer, fname, chunks, manifest.block_bytes, lambda: None, windows)
            except BaseException:
                writer.abort()
                raise
            writer.close()
            files[fname] = entry
            for (n, _), r in zip(members, records, strict=True):
                new_chunks.setdefault(n, []).append(r)
    finally:
        reads.close()
    tensors = {
        n: TensorEntry(t.dtype, t.shape, tuple(sorted(new_chunks[n], key=lambda c: c.offsets)))
        for n, t in manifest.tensors.items()
    }
    copy = replace(
        manifest,
        save_id=save_id,
        created=time.time(),
        tensors=tensors,
        files=files,
        refs={},
        format_version=FORMAT_VERSION,  # the files just written have an index
        meshes=[],
    )
    raw = copy.to_bytes()
    tracker.phase = "publish"
    commit = publication.verify(raw, files, deadline)  # never commit what a loader would refuse
    publication.publish(commit, overwrite=False, at_commit=lambda: None, deadline=deadline)
    total = sum(f.size for f in files.values())
    return ConsolidateResult(out, len(tensors), total, sorted(files), sorted(manifest.refs))


def _meta(manifest: Manifest, name: str, c: Chunk) -> torch.Tensor:
    """A chunk's shape and dtype, without memory (what :class:`PendingChunk` needs to build a header)."""
    return torch.empty(c.sizes, dtype=manifest.tensors[name].dtype, device="meta")


def _bytes(
    storage: Storage, src: str, manifest: Manifest, members: list[tuple[str, Chunk]], reads: Lane, deadline: Deadline
) -> Iterator[memoryview]:
    """The bytes of ``members`` in order, one verified checksum block at a time, each read on ``reads``
    and waited for until ``deadline``."""
    block = manifest.block_bytes
    got: list[bytes] = []

    def keep(_offset: int, view: memoryview) -> None:
        got.append(bytes(view))

    for name, c in members:
        path = chunk_path(storage, src, c)
        length = c.end - c.begin
        for k in range(max(1, -(-length // block))):
            lo, hi = k * block, min((k + 1) * block, length)
            with mapped_errors("export", src):
                try:
                    reads.call(
                        "reading a block",
                        path,
                        functools.partial(read_blocks, storage, path, c, block, lo, hi, name, None, keep),
                        deadline,
                    )
                except (FileNotFoundError, NotADirectoryError) as err:  # a base moved away, or now a file
                    if c.ref:
                        raise missing_base(src, manifest, c.ref, c.file, path) from err
                    raise CorruptCheckpointError(f"{path}: data file missing") from err
                except EOFError as err:
                    raise CorruptCheckpointError(f"{path}: {err}") from err
            for view in got:
                yield memoryview(view)
            got.clear()
