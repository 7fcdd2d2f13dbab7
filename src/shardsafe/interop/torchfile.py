"""Export one entry of a checkpoint as a single ``torch.save`` file, for tools that want one.

Unlike the Hugging Face export this holds the exported entry in memory (``torch.save`` pickles one
object); its structure is kept (a module entry becomes its ``state_dict``). The file is written beside
the target under a hidden name, fsynced, and linked into place, which fails rather than replace
anything: an existing target is refused, since nothing in a ``torch.save`` file says who wrote it.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from shardsafe import knobs
from shardsafe.catalog.publish import FilePublication
from shardsafe.deadline import Deadline
from shardsafe.engine.guard import entry_point, mapped_errors
from shardsafe.engine.read import check_sizes, load_bytes, plan_reads, read_manifest, run_tasks
from shardsafe.errors import CheckpointExistsError, InvalidArgumentError
from shardsafe.format.values import decode, validate
from shardsafe.interop.hf import ExportResult, _out_dtype, resolve_dtype
from shardsafe.interop.outdir import check_parents, inside, make_parents
from shardsafe.interop.select import select
from shardsafe.progress.record import ProgressCallback, check_callback
from shardsafe.progress.tracker import tracked
from shardsafe.storage import get_storage, is_remote

logger = logging.getLogger(__name__)


@entry_point("export", reads=True)
def export_torch(
    checkpoint: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    key: str | None = None,
    dtype: str | torch.dtype | None = None,
    allow_pickle: bool = False,
    timeout: float | None = None,
    storage_options: dict[str, Any] | None = None,
    progress: ProgressCallback | None = None,
) -> ExportResult:
    """Write entry ``key`` of the checkpoint at ``checkpoint`` (default: its one module; ``"/"``: every
    entry) to the new file ``out`` with ``torch.save`` (one process). ``dtype`` converts floating tensors.
    ``out`` must not exist (:class:`CheckpointExistsError`); it appears whole or not at all.
    ``progress``: as for :func:`~shardsafe.interop.hf.export_hf`, counting the tensor bytes read and
    verified (phase ``read``; ``write`` while ``torch.save`` writes the file)."""
    progress = check_callback(progress)
    started = time.monotonic()
    source, target = os.fspath(checkpoint), os.path.abspath(os.fspath(out))
    out_dtype = resolve_dtype(dtype)
    if is_remote(os.fspath(out)):
        raise InvalidArgumentError(f"export writes a local file, not {out!r}; export locally, then upload it")
    if not is_remote(source) and inside(target, source):
        raise InvalidArgumentError(f"{target} lies inside the checkpoint {source}; export to a path outside it")
    if os.path.lexists(target):
        raise CheckpointExistsError(f"{target} exists: refused, nothing was changed. Export to a new file name")
    parent = os.path.dirname(target)
    check_parents(parent)
    with tracked("export", source, progress, "manifest") as tracker:
        storage = get_storage(source, storage_options)
        with mapped_errors("export", source):
            manifest = read_manifest(storage, source)
            chosen = select(manifest, key, source)
            validate(chosen.node, f"{source}: {chosen.key}", allow_pickle=allow_pickle)
            refs = [ref for _, ref in chosen.tensors]
            check_sizes(storage, source, manifest, refs)
            tensors: dict[str, torch.Tensor] = {}
            tasks = []
            for ref in refs:
                entry = manifest.tensors[ref]
                tensors[ref] = torch.empty(entry.shape, dtype=entry.dtype)
                tasks += plan_reads(ref, entry, tensors[ref], (0,) * len(entry.shape))
            tracker.set_total(load_bytes(manifest, tasks))
            tracker.phase = "read"
            deadline = Deadline.after(timeout or knobs.io_timeout(), "io")
            run_tasks(storage, source, manifest, tasks, lambda: None, deadline, tracker.add)
            tracker.phase = "write"
            for ref, t in tensors.items():
                tensors[ref] = t.to(_out_dtype(t.dtype, out_dtype))
            value = decode(chosen.node, f"{source}: {chosen.key}", tensors.__getitem__, allow_pickle=allow_pickle)
        publication = FilePublication(target, make_parents(parent))  # write hidden, verify, publish, retire
        done = False
        try:
            torch.save(value, publication.hidden)
            publication.verify()
            publication.publish()
            done = True
        finally:
            publication.retire(published=done)
    total = sum(t.nbytes for t in tensors.values())
    logger.info(
        "shardsafe: exported %s [%s] to %s (torch.save): %d tensors, %.1f MiB, %.2fs",
        source,
        chosen.key,
        target,
        len(tensors),
        total / 2**20,
        time.monotonic() - started,
    )
    return ExportResult(
        path=target,
        files=[os.path.basename(target)],
        tensors=len(tensors),
        bytes=total,
        skipped=[],
        key=chosen.key,
    )
