"""Incremental saves (``save(path, state, base=BASE)``): a chunk whose bytes equal those of the chunk
of the same tensor and box in the committed checkpoint BASE is not written again; the new manifest
refers to the file that holds those bytes (format v2 ``refs``; docs/incremental.md).

Nothing is taken on trust, neither the caller's word nor BASE's manifest. Equality is decided from
content: each candidate chunk (same tensor name, dtype, global shape, box and checksum block size as
a chunk of BASE) is hashed (xxh3-128) from this rank's memory before it is staged and compared with
the digest BASE's manifest records for that chunk (cheap: most changed chunks stop here). Where they
are equal, the bytes the reference would point at are read back and verified before anything refers
to them: the file's name is a data file of the save that wrote it (what the ``refs`` table may
hold), its size, header checksum and safetensors header are the ones the new manifest will record,
every block matches the checksum that will be copied, and the xxh3-128 of the bytes read equals the
digest (so a digest left stale by changed bytes cannot make a save refer to other bytes than the
state's). A chunk that fails any of these is written in full, with one WARNING per base file naming
it and why.

Call order within a save (:class:`~shardsafe.engine.save.SaveJob`):

- (rank 0, before the save id is broadcast) :func:`check_base`: BASE (a symbolic link resolved to
  the checkpoint it points to, which the new manifest then names) is a committed sibling of the
  target, not the target, and does not refer to the target;
- (every rank, after planning) :func:`read_base` then :func:`match`: the chunks this rank still
  writes, and the references for the rest (one hop: a chunk BASE itself took from an older
  checkpoint refers to that older checkpoint directly, and is verified there), each verified in the
  file it points at;
- (rank 0, building the manifest) :func:`ref_table`: the referenced files, with their sizes, header
  checksums and save ids, taken from BASE's manifest (each checked against the file by the rank that
  referred to it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Sequence

import torch
import xxhash

from shardsafe import knobs
from shardsafe.catalog.names import DATA_FILE, basename, link_target
from shardsafe.catalog.refs import sibling, split
from shardsafe.deadline import Deadline
from shardsafe.engine.plan import PendingChunk
from shardsafe.engine.read import chunk_source, open_manifest

# BaseRefusedError is defined in shardsafe.errors with every public error; importing it from here keeps
# working for one release (the same class object, re-exported).
from shardsafe.errors import BaseRefusedError as BaseRefusedError
from shardsafe.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from shardsafe.format.datafile import read_blocks, tensor_bytes, verify_header
from shardsafe.format.manifest import Chunk, FileEntry, Manifest, RefEntry, check_file_name
from shardsafe.storage import Storage
from shardsafe.workers import run_bounded

logger = logging.getLogger(__name__)


def check_base(storage: Storage, target: str, base: str) -> str:
    """(rank 0, before the save starts) The broadcast record for ``base``: its path, name and save id,
    or ``{"base_error": why}``. Reads only BASE's manifest: its files, and those it refers to, are
    checked chunk by chunk by :func:`match` (what does not verify is written in full)."""
    try:
        base = _resolved(storage, target, base)
        manifest = _usable(storage, target, base)
    except (CheckpointError, OSError) as err:
        return json.dumps({"base_error": str(err)})
    return json.dumps({"base": base, "base_name": split(base)[1], "base_sid": manifest.save_id})


def _resolved(storage: Storage, target: str, base: str) -> str:
    """``base``, or, when it is a symbolic link (``run/latest``), the sibling checkpoint it points to:
    the reference the new manifest records, and what the delete rule then sees as referred to (a
    reference by the link's name would not keep the real checkpoint's files when it is overwritten).
    A link that leads anywhere but into the target's own folder is refused."""
    real = link_target(base)
    if real is None:
        return base
    parent = split(target)[0]
    local_parent = parent.removeprefix("file://")
    if os.path.dirname(real) != os.path.realpath(local_parent):
        raise BaseRefusedError(
            f"save of {target!r}: base {base!r} is a symbolic link to {real}, which is not a sibling of the target "
            f"(a reference may only point into a checkpoint under the same parent folder, {parent!r}); pass base= "
            "the path of a committed checkpoint in the same folder as the target, or no base"
        )
    return storage.join(parent, basename(real))


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
        manifest = open_manifest(storage, base)
    except CheckpointNotFoundError as err:
        raise CheckpointNotFoundError(
            f"save of {target!r}: base {base!r} is not a committed checkpoint ({err}); {fix}"
        ) from None
    if tname in manifest.refs:
        raise BaseRefusedError(
            f"save of {target!r}: base {base!r} refers to data stored in {tname!r}, the target of this save; "
            f"replacing it would break the base. Save to a new path, or {fix}"
        )
    return manifest


def read_base(storage: Storage, base: str, save_id: str) -> Manifest:
    """(every rank) BASE's manifest, which must be the one rank 0 checked (same save id)."""
    manifest = open_manifest(storage, base)
    if manifest.save_id != save_id:
        raise BaseRefusedError(
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
    chunks: Sequence[PendingChunk],
    base: Manifest,
    base_name: str,
    block_bytes: int,
    storage: Storage,
    target: str,
    deadline: Deadline,
) -> tuple[list[PendingChunk], list[tuple[str, Chunk]]]:
    """(every rank, after planning, before staging) Split this rank's chunks into those to write and
    ``(tensor name, reference)`` for those whose bytes BASE already holds, verified in the file each
    reference points at (module docstring; BASE, or the checkpoint BASE refers to, beside ``target``).
    The reads run within ``deadline`` (:class:`CheckpointTimeoutError` past it: the save fails rather than
    hang)."""
    candidates: list[tuple[PendingChunk, Chunk]] = []
    same_blocks = base.block_bytes == block_bytes  # a reference keeps the base's block checksums
    source = chunk_source(storage, sibling(storage, target, base_name), base)
    unreadable: set[str] = set()
    for c in chunks:
        entry = base.tensors.get(c.name) if same_blocks else None
        old = None
        if entry is not None and entry.dtype == c.data.dtype and c.nbytes:
            listed: Sequence[Chunk] = entry.chunks
            if entry.sharding is not None:  # format v3: the base's chunk from the index of the file holding it
                try:
                    listed = source.chunks(c.name, (c.offsets, c.sizes)) if not unreadable else []
                except (CorruptCheckpointError, OSError, EOFError) as err:
                    _warn(target, base_name, base_name, 1, 1, _reason(err))
                    unreadable.add(c.name)  # one warning: every chunk the base rules is written in full
                    listed = []
            old = next((b for b in listed if b.offsets == c.offsets and b.sizes == c.sizes), None)
        if old is None:
            continue
        if old.digest is not None and chunk_digest(c.data) == old.digest:
            candidates.append((c, old))
        elif entry is not None and entry.sharding is not None and chunk_sums(c.data, block_bytes) == old.checksums:
            # a ruled chunk (format v3) has no digest: compared by its block checksums; its bytes read back
            # must then have this chunk's digest, which the reference records
            candidates.append((c, dataclasses.replace(old, digest=chunk_digest(c.data))))
    sound: set[int] = set()
    if candidates:  # nothing to read back: no worker thread
        sound = run_bounded(
            "reading back the base's chunks",
            sibling(storage, target, base_name),
            deadline,
            lambda: _verified(storage, target, base, base_name, candidates),
        )
    refs = [
        (c.name, Chunk(*_fields(old), ref=old.ref or base_name)) for i, (c, old) in enumerate(candidates) if i in sound
    ]
    kept = {id(candidates[i][0]) for i in sound}
    write = [c for c in chunks if id(c) not in kept]
    logger.debug(
        "shardsafe: incremental save: %d chunk(s) unchanged since %s (verified in its files), %d written",
        len(refs),
        base_name,
        len(write),
    )
    return write, refs


def _verified(
    storage: Storage, target: str, base: Manifest, base_name: str, candidates: Sequence[tuple[PendingChunk, Chunk]]
) -> set[int]:
    """The indices of ``candidates`` whose base chunk verifies in its file (module docstring); one
    WARNING per file for the others. Reads each file's header once and each candidate chunk once, in
    file order, one checksum block at a time."""
    by_file: dict[tuple[str, str], list[int]] = {}
    for i, (_, old) in enumerate(candidates):
        by_file.setdefault((old.ref or base_name, old.file), []).append(i)
    largest = max((min(old.end - old.begin, base.block_bytes) for _, old in candidates), default=0)
    buffer = memoryview(bytearray(largest))
    sound: set[int] = set()
    for (holder, name), members in sorted(by_file.items()):
        members.sort(key=lambda i: candidates[i][1].begin)
        save_id, entry = _file_entry(base, base_name, holder, name)
        path = storage.join(sibling(storage, target, holder), name)
        keyed = [i for i in members if not _ruled(base, candidates[i])]  # ruled ones: checked with the index
        olds = [candidates[i][1] for i in keyed]
        try:
            _check_name(name, save_id)
            verify_header(storage, path, entry, olds, [candidates[i][0].data.dtype for i in keyed], subset=True)
        except (CorruptCheckpointError, OSError, EOFError) as err:
            _warn(target, holder, path, len(members), len(members), _reason(err))
            continue
        failed: list[str] = []
        for i in members:
            new, old = candidates[i]
            try:
                if _digest_of(storage, path, old, base.block_bytes, new.name, lambda n: buffer[:n]) == old.digest:
                    sound.add(i)
                    continue
                failed.append(
                    f"the bytes of tensor {new.name!r} (chunk at {list(old.offsets)}) do not have the content digest "
                    "the manifest records for them (changed since, or the digest altered)"
                )
            except (CorruptCheckpointError, OSError, EOFError) as err:
                failed.append(_reason(err))
        if failed:
            _warn(target, holder, path, len(failed), len(members), failed[0])
    return sound


def _ruled(base: Manifest, candidate: tuple[PendingChunk, Chunk]) -> bool:
    """Whether the base holds ``candidate``'s chunk by a sharding rule (format v3): in its file's ruled
    region, found (and the header and index checked) through the file's index, not a header entry."""
    new, old = candidate
    return old.ref is None and base.tensors[new.name].sharding is not None


def chunk_sums(data: torch.Tensor, block: int) -> tuple[str, ...]:
    """The block checksums (xxh3-64 per ``block`` bytes) of a tensor's bytes, as a data file records them."""
    raw = tensor_bytes(data.detach().cpu().contiguous())
    if not len(raw):
        return (xxhash.xxh3_64_hexdigest(b""),)
    return tuple(xxhash.xxh3_64_hexdigest(raw[i : i + block]) for i in range(0, len(raw), block))


def _file_entry(base: Manifest, base_name: str, holder: str, name: str) -> tuple[str, FileEntry]:
    """(save id, entry) of the file ``name`` of checkpoint ``holder`` as BASE's manifest records it:
    what :func:`ref_table` copies into the new manifest."""
    if holder == base_name:
        return base.save_id, base.files[name]
    return base.refs[holder].save_id, base.refs[holder].files[name]


def _check_name(name: str, save_id: str) -> None:
    """A referenced file must be a data file of the save that wrote it (format v2, ``refs``): a base
    whose file has another valid name (renamed, or written by hand) can be loaded but not referred to."""
    m = DATA_FILE.match(name)
    if m is None or m["sid"] != save_id:
        raise CorruptCheckpointError(
            f"its name is not that of a data file of save {save_id} (data-<rank>-{save_id}.safetensors), which a "
            "reference must name"
        )


def _digest_of(
    storage: Storage, path: str, chunk: Chunk, block: int, tensor: str, bounce: Callable[[int], memoryview]
) -> str:
    """The xxh3-128 of the chunk's bytes in ``path``, read one block at a time into ``bounce`` and each
    block checked against its checksum first (:class:`CorruptCheckpointError` on a mismatch)."""
    h = xxhash.xxh3_128()
    read_blocks(
        storage, path, chunk, block, 0, chunk.end - chunk.begin, tensor, bounce, lambda _at, data: h.update(data)
    )
    return h.hexdigest()


def _reason(err: BaseException) -> str:
    return str(err) if isinstance(err, CheckpointError) else f"{type(err).__name__}: {err}"


def _warn(target: str, holder: str, path: str, failed: int, total: int, why: str) -> None:
    logger.warning(
        "shardsafe: incremental save of %s: %s, a data file of the base checkpoint %r, does not verify (%s); %d of "
        "the %d chunk(s) this save would have taken from it are written in full instead. The save goes on; "
        "check or replace that checkpoint (shardsafe verify).",
        target,
        path,
        holder,
        why,
        failed,
        total,
    )


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
