"""Reading tensors out of a checkpoint: only the byte ranges a destination box needs, verified block
by block, copied straight into the destination when it is a contiguous CPU tensor of the saved dtype.

A destination is a tensor (this rank's local data) and its global offsets; it may cut across the
saved chunks in any way (resharding between any world sizes).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass

import torch

from shardsafe import knobs
from shardsafe.engine.memory import available_memory
from shardsafe.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from shardsafe.format.datafile import read_verified, tensor_bytes
from shardsafe.format.manifest import Chunk, Manifest, TensorEntry, parse_manifest
from shardsafe.storage import MANIFEST_NAME, Storage


def read_manifest(storage: Storage, path: str) -> Manifest:
    """(any rank) The validated manifest of the committed checkpoint at ``path``. Reads at most
    ``SHARDSAFE_MAX_MANIFEST_BYTES`` of a regular file; raises only checkpoint errors
    (:class:`CheckpointNotFoundError`, :class:`CorruptCheckpointError`)."""
    where = storage.join(path, MANIFEST_NAME)
    try:
        raw = storage.read_bytes(where)
    except FileNotFoundError:
        raise _not_found(storage, path) from None
    except IsADirectoryError:
        raise CorruptCheckpointError(f"{where} is a directory, not a manifest") from None
    except NotADirectoryError:
        raise CheckpointNotFoundError(f"{path} is a file, not a checkpoint directory; check the path") from None
    return parse_manifest(raw, where)


def check_sizes(storage: Storage, path: str, manifest: Manifest, tensors: Sequence[str]) -> None:
    """Before allocating ``tensors`` from manifest shapes: their data files must really be as large as
    the manifest says (and regular files), so a forged shape cannot make a reader allocate memory the
    files do not back."""
    files = sorted({c.file for t in tensors for c in manifest.tensors[t].chunks})
    for name in files:
        file = storage.join(path, name)
        try:
            size = storage.size(file)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{file}: data file missing") from None
        if size != manifest.files[name].size:
            raise CorruptCheckpointError(
                f"{file}: {size} bytes, the manifest says {manifest.files[name].size} (truncated or altered)"
            )


def check_allocation(storage: Storage, path: str, manifest: Manifest, tensors: Sequence[str]) -> None:
    """(the process about to allocate) Before allocating ``tensors`` fresh from manifest shapes: the
    files back them (:func:`check_sizes`) and their bytes fit in the memory available to this process
    (a sparse file makes a forged shape look backed). Raises :class:`CheckpointError` naming the
    largest tensor, before any allocation."""
    check_sizes(storage, path, manifest, tensors)
    wanted = set(tensors)
    need = sum(manifest.tensors[t].nbytes for t in wanted)
    have = available_memory()
    if wanted and need > have:
        largest = max(wanted, key=lambda t: manifest.tensors[t].nbytes)
        raise CheckpointError(
            f"load of {path!r}: its tensors need {need} bytes of memory (the largest, {largest!r}, "
            f"{manifest.tensors[largest].nbytes}), but only {have} are available to this process. Load into a "
            "state whose tensors already exist (filled in place), or on a machine with more memory."
        )


def _not_found(storage: Storage, path: str) -> CheckpointNotFoundError:
    if storage.list_dir(path):
        return CheckpointNotFoundError(
            f"{path} holds no MANIFEST.json: it is an uncommitted (interrupted or failed) save, not a checkpoint. "
            "Load an older checkpoint; a CheckpointManager removes such leftovers."
        )
    return CheckpointNotFoundError(f"no checkpoint at {path} (no MANIFEST.json); check the path")


@dataclass
class Task:
    """Copy the part of ``chunk`` that overlaps the destination into ``dest``."""

    name: str
    chunk: Chunk
    dest: torch.Tensor  # the destination region (a view), shaped like the overlap
    box_lo: tuple[int, ...]  # overlap, in chunk-local coordinates
    box_hi: tuple[int, ...]


def plan_reads(name: str, entry: TensorEntry, dest: torch.Tensor, offsets: Sequence[int]) -> list[Task]:
    """Tasks that fill ``dest`` (global offsets ``offsets``) from the chunks of ``entry``."""
    tasks = []
    for c in entry.chunks:
        lo = [max(co, do) for co, do in zip(c.offsets, offsets, strict=True)]
        hi = [min(co + cs, do + ds) for co, cs, do, ds in zip(c.offsets, c.sizes, offsets, dest.shape, strict=True)]
        if any(h <= low for low, h in zip(lo, hi, strict=True)) and entry.shape:
            continue
        region = dest[tuple(slice(a - d, b - d) for a, b, d in zip(lo, hi, offsets, strict=True))]
        tasks.append(
            Task(
                name,
                c,
                region,
                tuple(a - o for a, o in zip(lo, c.offsets, strict=True)),
                tuple(b - o for b, o in zip(hi, c.offsets, strict=True)),
            )
        )
    return tasks


def run_tasks(
    storage: Storage,
    path: str,
    manifest: Manifest,
    tasks: Sequence[Task],
    on_first: Callable[[], None],
    timeout: float,
) -> int:
    """Execute the reads on a few threads (each raises through its future) within ``timeout``
    seconds; returns the bytes read. A read still running at the deadline (a hung network
    filesystem) raises instead of blocking: the pool is abandoned, its threads end with their reads."""
    if not tasks:
        return 0
    deadline = time.monotonic() + timeout
    threads = max(1, min(knobs.io_threads(), len(tasks)))
    pool = ThreadPoolExecutor(threads, thread_name_prefix="shardsafe-read")
    total = 0
    try:
        futures = [pool.submit(_run, storage, path, manifest, t) for t in tasks]
        for i, f in enumerate(futures):
            try:
                total += f.result(timeout=max(0.0, deadline - time.monotonic()))
            except FuturesTimeout:
                raise CheckpointError(
                    f"load of {path!r}: reads did not finish within {timeout:.0f}s (storage hung or far too slow); "
                    "raise timeout= or SHARDSAFE_IO_TIMEOUT if it is merely slow"
                ) from None
            if i == 0:
                on_first()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return total


def _run(storage: Storage, path: str, manifest: Manifest, t: Task) -> int:
    c = t.chunk
    file = storage.join(path, c.file)
    dtype = manifest.tensors[t.name].dtype
    if not c.sizes:  # a 0-d tensor
        tmp = torch.empty((), dtype=dtype)
        _read(storage, file, c, manifest.block_bytes, 0, tmp, t.name)
        t.dest.copy_(tmp)
        return dtype.itemsize
    row = math.prod(c.sizes[1:]) * dtype.itemsize
    full_rows = t.box_lo[1:] == (0,) * (len(c.sizes) - 1) and t.box_hi[1:] == tuple(c.sizes[1:])
    start, stop = t.box_lo[0] * row, t.box_hi[0] * row
    direct = full_rows and t.dest.dtype == dtype and t.dest.device.type == "cpu" and t.dest.is_contiguous()
    if direct:
        _read(storage, file, c, manifest.block_bytes, start, t.dest, t.name)
        return stop - start
    rows = torch.empty((t.box_hi[0] - t.box_lo[0], *c.sizes[1:]), dtype=dtype)
    _read(storage, file, c, manifest.block_bytes, start, rows, t.name)
    src = rows[(slice(None), *(slice(a, b) for a, b in zip(t.box_lo[1:], t.box_hi[1:], strict=True)))]
    t.dest.copy_(src)
    return stop - start


def _read(storage: Storage, file: str, c: Chunk, block: int, start: int, out: torch.Tensor, name: str) -> None:
    try:
        read_verified(storage, file, c, block, start, tensor_bytes(out), name)
    except (EOFError, FileNotFoundError) as err:
        raise CorruptCheckpointError(f"{file}: cannot read tensor {name!r}: {err}") from err
