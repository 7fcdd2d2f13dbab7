"""Incremental saves (``save(path, state, base=BASE)``): a chunk whose bytes equal those of the chunk
of the same tensor and box in the committed checkpoint BASE is not written again; the new manifest
refers to the file that holds those bytes (format v2 ``refs``; docs/incremental.md).

Equality is decided from content: each candidate chunk (same tensor name, dtype, global shape, box
and checksum block size as a chunk of BASE) is hashed (xxh3-128) from this rank's memory before it
is staged, and compared with the digest BASE's manifest records for that chunk. Nothing is taken on
trust: not timestamps, not the caller's word.

Call order within a save (:class:`~shardsafe.engine.save.SaveJob`):

- (rank 0, before the save id is broadcast) :func:`check_base`: BASE is a committed sibling of the
  target, not the target, not referring to the target, its own references intact;
- (every rank, after planning) :func:`read_base` then :func:`match`: the chunks this rank still
  writes, and the references for the rest (one hop: a chunk BASE itself took from an older
  checkpoint refers to that older checkpoint directly);
- (rank 0, building the manifest) :func:`ref_table`: the referenced files, with their sizes, header
  checksums and save ids, taken from BASE's manifest.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

import torch
import xxhash

from shardsafe import knobs
from shardsafe.engine.plan import PendingChunk
from shardsafe.engine.read import read_manifest
from shardsafe.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from shardsafe.format.datafile import tensor_bytes
from shardsafe.format.manifest import Chunk, Manifest, RefEntry, check_file_name
from shardsafe.storage import Storage
from shardsafe.storage.refs import check_ref_files, split

logger = logging.getLogger(__name__)


class BaseRefusedError(CheckpointError, ValueError):
    """``base=`` names no usable base for this save (raised on every rank from rank 0's check)."""


def check_base(storage: Storage, target: str, base: str) -> str:
    """(rank 0, before the save starts) The broadcast record for ``base``: its path, name and save id,
    or ``{"base_error": why}``. Reads only BASE's manifest (and stats its referenced files)."""
    try:
        manifest = _usable(storage, target, base)
    except (CheckpointError, OSError) as err:
        return json.dumps({"base_error": str(err)})
    return json.dumps({"base": base, "base_name": split(base)[1], "base_sid": manifest.save_id})


def _usable(storage: Storage, target: str, base: str) -> Manifest:
    (tparent, tname), (bparent, bname) = split(target), split(base)
    fix = "pass base= the path of a committed checkpoint in the same folder as the target, or no base"
    if (tparent, tname) == (bparent, bname):
        raise BaseRefusedError(f"save of {target!r}: base= is the target itself; {fix}")
    if tparent != bparent:
        raise BaseRefusedError(
            f"save of {target!r}: base {base!r} is not a sibling of the target (a reference may only point into "
            f"a checkpoint under the same parent folder, {tparent!r}); {fix}"
        )
    try:
        check_file_name(bname, "base")
    except CorruptCheckpointError:
        raise BaseRefusedError(
            f"save of {target!r}: base name {bname!r} is not a plain name (letters, digits, '.', '_', '-'; not "
            f"hidden), which a reference must be; rename the base or {fix}"
        ) from None
    try:
        manifest = read_manifest(storage, base)
    except CheckpointNotFoundError as err:
        raise CheckpointNotFoundError(
            f"save of {target!r}: base {base!r} is not a committed checkpoint ({err}); {fix}"
        ) from None
    if tname in manifest.refs:
        raise BaseRefusedError(
            f"save of {target!r}: base {base!r} refers to data stored in {tname!r}, the target of this save; "
            f"replacing it would break the base. Save to a new path, or {fix}"
        )
    check_ref_files(storage, base, manifest)
    return manifest


def read_base(storage: Storage, base: str, save_id: str) -> Manifest:
    """(every rank) BASE's manifest, which must be the one rank 0 checked (same save id)."""
    manifest = read_manifest(storage, base)
    if manifest.save_id != save_id:
        raise CheckpointError(
            f"base {base!r} changed during the save (save id {manifest.save_id}, rank 0 saw {save_id}); do not "
            "replace the base while a save uses it, then save again"
        )
    return manifest


def chunk_digest(data: torch.Tensor) -> str:
    """xxh3-128 of a tensor's bytes in row-major order (a device tensor is copied to the host in
    pieces of ``SHARDSAFE_WRITE_PIECE_BYTES``)."""
    data = data.detach()
    if data.device.type == "cpu":
        return xxhash.xxh3_128_hexdigest(tensor_bytes(data if data.is_contiguous() else data.contiguous()))
    flat = data.contiguous().reshape(-1).view(torch.uint8)
    piece = max(1, knobs.write_piece_bytes())
    h = xxhash.xxh3_128()
    for start in range(0, flat.numel(), piece):
        h.update(tensor_bytes(flat[start : start + piece].cpu()))
    return h.hexdigest()


def match(
    chunks: Sequence[PendingChunk], base: Manifest, base_name: str, block_bytes: int
) -> tuple[list[PendingChunk], list[tuple[str, Chunk]]]:
    """(every rank, after planning, before staging) Split this rank's chunks into those to write and
    ``(tensor name, reference)`` for those whose bytes BASE already holds. References point at the
    checkpoint that holds the bytes (BASE, or the one BASE refers to)."""
    write: list[PendingChunk] = []
    refs: list[tuple[str, Chunk]] = []
    same_blocks = base.block_bytes == block_bytes  # a reference keeps the base's block checksums
    for c in chunks:
        entry = base.tensors.get(c.name) if same_blocks else None
        old = None
        if entry is not None and entry.dtype == c.data.dtype and c.nbytes:
            old = next((b for b in entry.chunks if b.offsets == c.offsets and b.sizes == c.sizes), None)
        if old is None or old.digest is None or chunk_digest(c.data) != old.digest:
            write.append(c)
            continue
        refs.append((c.name, Chunk(*_fields(old), ref=old.ref or base_name)))
    logger.debug(
        "shardsafe: incremental save: %d chunk(s) unchanged since %s, %d written", len(refs), base_name, len(write)
    )
    return write, refs


def _fields(c: Chunk) -> tuple[tuple[int, ...], tuple[int, ...], str, str, int, int, tuple[str, ...], str | None]:
    return (c.offsets, c.sizes, c.file, c.key, c.begin, c.end, c.checksums, c.digest)


def ref_table(base: Manifest, base_name: str, chunks: Sequence[Chunk]) -> dict[str, RefEntry]:
    """(rank 0) The ``refs`` of the new manifest: each referenced checkpoint's save id and the entries
    (size, header checksum) of the files its chunks use, copied from BASE's manifest."""
    table: dict[str, RefEntry] = {}
    for c in chunks:
        if c.ref is None:
            continue
        if c.ref == base_name:
            sid, entry = base.save_id, base.files[c.file]
        else:
            sid, entry = base.refs[c.ref].save_id, base.refs[c.ref].files[c.file]
        table.setdefault(c.ref, RefEntry(sid, {})).files[c.file] = entry
    return table
