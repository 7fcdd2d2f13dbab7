"""Export to the Hugging Face layout: ``model.safetensors``, or ``model-0000X-of-0000N.safetensors``
shards plus ``model.safetensors.index.json``, as ``save_pretrained`` writes them.

Runs in one process and talks to no rank; reads only the manifest and the byte ranges it needs.
Tensors stream from the checkpoint to the shard files a slab at a time (whatever the saved world
size: chunks are reassembled in row-major order), every byte verified against its checksum, so
memory stays at two slabs (``SHARDSAFE_EXPORT_SLAB_BYTES``) plus a converted copy, however large the
model or its largest tensor. Shards are planned the way ``huggingface_hub`` splits a state dict
(in order; a new shard when the next tensor would pass ``max_shard_size``; a larger tensor alone).
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shardsafe import knobs
from shardsafe.engine.guard import entry_point, mapped_errors
from shardsafe.engine.read import check_sizes, read_manifest
from shardsafe.errors import InternalError, InvalidArgumentError
from shardsafe.format.datafile import tensor_bytes
from shardsafe.format.manifest import SAFETENSORS_DTYPES, Manifest
from shardsafe.interop.names import wrapper_prefix
from shardsafe.interop.outdir import ExportDir, write_all
from shardsafe.interop.select import select
from shardsafe.interop.stream import Piece, PieceReader, pieces, same_bytes
from shardsafe.interop.ties import describe_model
from shardsafe.progress.record import ProgressCallback, check_callback
from shardsafe.progress.tracker import tracked
from shardsafe.storage import get_storage

logger = logging.getLogger(__name__)

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
"""What ``dtype=`` may name; only tensors of these floating dtypes (and float64) are converted."""
_CASTABLE = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote."""

    path: str  # the export directory
    files: list[str]  # the weight files, in order
    tensors: int  # tensors written
    bytes: int  # tensor bytes written (the index's total_size)
    tied: dict[str, str] = field(default_factory=dict)  # left-out name -> the name it is tied to
    skipped: list[str] = field(default_factory=list)  # non-tensor values of the sub-tree, not exported
    key: str = ""  # the checkpoint entry exported
    stripped: str = ""  # a wrapper's prefix found and stripped from every name (interop/names.py)


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a number with a unit (``5GB`` = 5e9, ``500MiB`` = 500 * 2**20)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(size))
        if m is None or m.group(2).upper() not in _UNITS:
            raise InvalidArgumentError(f"max_shard_size {size!r} is not a size; give bytes or e.g. 5GB, 500MB, 2GiB")
        value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value < 1:
        raise InvalidArgumentError(f"max_shard_size {size!r} must be at least one byte")
    return value


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype in DTYPES.values()):
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    raise InvalidArgumentError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")


@entry_point("export", reads=True)
def export_hf(
    checkpoint: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    key: str | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    tied: str = "auto",
    strip_prefix: str | None = None,
    overwrite: bool = False,
    timeout: float | None = None,
    storage_options: dict[str, Any] | None = None,
    progress: ProgressCallback | None = None,
) -> ExportResult:
    """Write the tensors of entry ``key`` of the checkpoint at ``checkpoint`` into the directory ``out`` in
    the Hugging Face safetensors layout (one process; reads any saved world size).

    ``key`` names the entry (default: the checkpoint's one module entry; a ``/`` path goes into an entry;
    ``"/"`` takes everything); tensor names are its ``state_dict`` names, minus ``strip_prefix``.
    ``dtype`` (``float32``, ``float16``, ``bfloat16``) converts floating tensors; ``max_shard_size``
    (default ``5GB``) bounds each shard, and a single ``model.safetensors`` is written when all fits.
    ``config`` (a ``config.json`` path or dict) is written as ``config.json`` and tells which weights
    the model ties: with ``tied="auto"`` a tied weight whose bytes equal its source's is written once,
    as ``save_pretrained`` does; ``tied="keep"`` (or no config) writes every tensor.

    ``out`` appears whole or not at all; it must be absent, empty, or a previous export (replaced only
    with ``overwrite=True``). Raises :class:`CheckpointExistsError` for any other ``out`` (untouched),
    :class:`CorruptCheckpointError` naming the file and tensor for a bad byte, ``ValueError`` for bad
    arguments. Every read waits at most ``timeout`` (default ``SHARDSAFE_IO_TIMEOUT``).

    ``progress``: a callable given :class:`~shardsafe.Progress` records (``op="export"``, ``path`` the
    checkpoint) from a thread of its own, counting the tensor bytes written (the ``bytes`` of the
    result), as :func:`shardsafe.verify` does (docs/progress.md).
    """
    progress = check_callback(progress)
    started = time.monotonic()
    source, target = os.fspath(checkpoint), os.fspath(out)
    out_dtype = resolve_dtype(dtype)
    limit = parse_size(max_shard_size)
    if tied not in ("auto", "keep"):
        raise InvalidArgumentError(f"tied={tied!r}: give 'auto' or 'keep'")
    config_doc = _config(config)
    model = describe_model(config_doc) if config_doc is not None else None
    with tracked("export", source, progress, "manifest") as tracker:
        storage = get_storage(source, storage_options)
        with mapped_errors("export", source):
            manifest = read_manifest(storage, source)
        chosen = select(manifest, key, source, strip_prefix=strip_prefix)
        names = [n for n, _ in chosen.tensors]
        stripped = wrapper_prefix(names, model, where=source, key=chosen.key, given=strip_prefix)
        if stripped:
            chosen = select(manifest, chosen.key, source, strip_prefix=stripped)
        if config_doc is not None and out_dtype is not None:
            config_doc = {**config_doc, "dtype": str(out_dtype).removeprefix("torch.")}
            if "torch_dtype" in config_doc:
                config_doc["torch_dtype"] = config_doc["dtype"]
        export = ExportDir(target, source=source, overwrite=overwrite)
        reader: PieceReader | None = None
        try:
            refs = dict(chosen.tensors)
            with mapped_errors("export", source):  # a base folder that became a file, a file cut short
                check_sizes(storage, source, manifest, list(refs.values()))
            slab = knobs.export_slab_bytes()
            todo = {name: pieces(manifest, ref, slab) for name, ref in chosen.tensors}
            capacity = max((p.nbytes for ps in todo.values() for p in ps), default=8)
            reader = PieceReader(storage, source, manifest, min(capacity, max(slab, 8)), timeout or knobs.io_timeout())
            ties = _ties(manifest, reader, refs, model.ties, slab) if tied == "auto" and model is not None else {}
            names = [n for n, _ in chosen.tensors if n not in ties]
            sizes = {n: _out_nbytes(manifest, refs[n], out_dtype) for n in names}
            shards = plan_shards(names, sizes, limit)
            tracker.set_total(sum(sizes.values()))
            tracker.phase = "write"
            files = [SINGLE] if len(shards) == 1 else [_shard_name(i, len(shards)) for i in range(len(shards))]
            cast = _cast_buffer(manifest, refs, todo, out_dtype)
            for file, shard in zip(files, shards, strict=True):
                _write_shard(export, file, shard, refs, manifest, reader, out_dtype, todo, cast, tracker.add)
            total = sum(sizes.values())
            if len(shards) > 1:
                index = {
                    "metadata": {"total_size": total},
                    "weight_map": {n: f for f, shard in zip(files, shards, strict=True) for n in shard},
                }
                export.write_file(INDEX, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
            if config_doc is not None:
                export.write_file(CONFIG, (json.dumps(config_doc, indent=2, sort_keys=True) + "\n").encode())
            tracker.phase = "publish"
            export.publish({"source": source, "save_id": manifest.save_id, "key": chosen.key})
        except BaseException:
            export.abort()
            raise
        finally:
            if reader is not None:
                reader.close()
    took = time.monotonic() - started
    logger.info(
        "shardsafe: exported %s [%s] to %s: %d tensors, %.1f MiB in %d file(s), %.2fs",
        source,
        chosen.key,
        export.target,
        len(names),
        total / 2**20,
        len(files),
        took,
    )
    return ExportResult(
        path=export.target,
        files=files,
        tensors=len(names),
        bytes=total,
        tied=ties,
        skipped=chosen.skipped,
        key=chosen.key,
        stripped=stripped,
    )


def plan_shards(names: Sequence[str], sizes: Mapping[str, int], limit: int) -> list[list[str]]:
    """Split ``names`` (in order) into shards of at most ``limit`` bytes, as ``huggingface_hub`` does: a new
    shard when the next tensor would pass the limit, and a tensor larger than the limit on its own."""
    shards: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name in names:
        if sizes[name] > limit:
            shards.append([name])
            continue
        if current and size + sizes[name] > limit:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += sizes[name]
    if current or not shards:
        shards.append(current)
    return shards


def _shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _config(config: str | os.PathLike[str] | Mapping[str, Any] | None) -> dict[str, Any] | None:
    if config is None or isinstance(config, Mapping):
        return None if config is None else dict(config)
    path = os.fspath(config)
    if os.path.isdir(path):
        path = os.path.join(path, CONFIG)
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read(16 * 2**20))
    except (OSError, ValueError) as err:
        raise InvalidArgumentError(
            f"config {path!r} is not a readable JSON file ({err}); give the model's config.json"
        ) from err
    if not isinstance(doc, dict):
        raise InvalidArgumentError(f"config {path!r} is not a JSON object; give the model's config.json")
    return doc


def _out_dtype(saved: torch.dtype, out_dtype: torch.dtype | None) -> torch.dtype:
    return out_dtype if out_dtype is not None and saved in _CASTABLE else saved


def _out_nbytes(manifest: Manifest, ref: str, out_dtype: torch.dtype | None) -> int:
    entry = manifest.tensors[ref]
    return entry.nbytes // entry.dtype.itemsize * _out_dtype(entry.dtype, out_dtype).itemsize


def _cast_buffer(
    manifest: Manifest, refs: Mapping[str, str], todo: Mapping[str, Sequence[Piece]], out_dtype: torch.dtype | None
) -> torch.Tensor:
    """Room for the largest converted piece (empty when nothing is converted)."""
    need = 0
    for name, ps in todo.items():
        saved = manifest.tensors[refs[name]].dtype
        if _out_dtype(saved, out_dtype) != saved:
            need = max([need, *(p.nbytes // saved.itemsize * _out_dtype(saved, out_dtype).itemsize for p in ps)])
    return torch.empty(need, dtype=torch.uint8)


def _ties(
    manifest: Manifest, reader: PieceReader, refs: Mapping[str, str], declared: Mapping[str, str], slab: int
) -> dict[str, str]:
    """The declared ties among the exported names whose bytes really are equal (else both are written)."""
    ties: dict[str, str] = {}
    for name, source in declared.items():
        if name not in refs or source not in refs:
            continue
        if same_bytes(manifest, reader, refs[name], refs[source], slab):
            ties[name] = source
        else:
            logger.warning(
                "shardsafe export: the config ties %s to %s, but the checkpoint holds different values for them; "
                "both are written",
                name,
                source,
            )
    return ties


def _write_shard(
    export: ExportDir,
    file: str,
    names: Sequence[str],
    refs: Mapping[str, str],
    manifest: Manifest,
    reader: PieceReader,
    out_dtype: torch.dtype | None,
    todo: Mapping[str, Sequence[Piece]],
    cast: torch.Tensor,
    on_bytes: Callable[[int], None],
) -> None:
    """One safetensors file: header (``__metadata__`` ``{"format": "pt"}``), then each tensor's bytes
    (converted into ``cast``, reused piece after piece, when ``out_dtype`` asks for it), each piece
    counted by ``on_bytes`` once written."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for name in names:
        entry = manifest.tensors[refs[name]]
        nbytes = _out_nbytes(manifest, refs[name], out_dtype)
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[_out_dtype(entry.dtype, out_dtype)],
            "shape": list(entry.shape),
            "data_offsets": [pos, pos + nbytes],
        }
        pos += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % 8)
    fd = export.create(file)
    try:
        write_all(fd, memoryview(struct.pack("<Q", len(text)) + text))
        written = 0
        for _, data in reader.stream([p for name in names for p in todo[name]]):
            want = _out_dtype(data.dtype, out_dtype)
            out = data.reshape(-1)
            if want != data.dtype:
                out = cast[: out.numel() * want.itemsize].view(want).copy_(out)
            view = tensor_bytes(out)
            write_all(fd, view)
            written += len(view)
            on_bytes(len(view))
        if written != pos:  # an internal invariant: the pieces of a tensor cover it exactly
            raise InternalError(f"export {file}: wrote {written} tensor bytes where the header says {pos}")
        os.fsync(fd)
    finally:
        os.close(fd)
