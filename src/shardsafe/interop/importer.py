"""Import a ``torch.save`` file or a DCP (``torch.distributed.checkpoint``) folder as a verified shardsafe
checkpoint. Runs in one process: the source is read whole into memory, saved with
:func:`shardsafe.save` (all-or-nothing, as every save) and then verified byte for byte.

Both sources are pickles at heart. A ``torch.save`` file is read with ``weights_only=True`` (tensors,
containers and plain values only; no code runs); full unpickling needs ``allow_pickle=True``. DCP keeps
its metadata (``.metadata``) as a plain pickle, so a DCP folder is read only with ``allow_pickle=True``.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from shardsafe.engine import api
from shardsafe.errors import CheckpointError, CheckpointNotFoundError, InvalidArgumentError, UnsafeValueError
from shardsafe.interop.outdir import inside
from shardsafe.storage import MANIFEST_NAME, is_remote

if TYPE_CHECKING:
    from shardsafe.engine.progress import ProgressCallback

logger = logging.getLogger(__name__)

WRAP_KEY = "state"
"""The one top-level key a source that is not a dict of plain string keys is saved under."""
DCP_METADATA = ".metadata"


@dataclass(frozen=True)
class ImportResult:
    path: str  # the new checkpoint
    source: str
    source_format: str  # "torch.save" or "dcp"
    keys: list[str]  # its top-level entries
    tensors: int
    bytes: int  # bytes verified
    wrapped: bool  # the source was not a dict of plain string keys: saved under WRAP_KEY


def import_checkpoint(
    source: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    *,
    allow_pickle: bool = False,
    overwrite: bool = False,
    timeout: float | None = None,
    progress: ProgressCallback | None = None,
) -> ImportResult:
    """Save what ``source`` holds (a ``torch.save`` file, or a DCP checkpoint folder) as the shardsafe
    checkpoint ``dest``, then verify it. One process, outside any distributed job.

    Nested dicts, lists and tuples of tensors and plain values keep their structure; a source that is
    a dict with string keys gives one checkpoint entry per key (else it is saved under ``"state"``).
    Raises :class:`UnsafeValueError` when reading would unpickle arbitrary objects (a DCP folder, or a
    ``torch.save`` file that ``weights_only`` refuses) without ``allow_pickle=True``; with it, values
    that typed JSON cannot hold are stored as pickle (loaded back only with ``allow_pickle=True``).
    ``dest`` follows :func:`shardsafe.save` (``CheckpointExistsError`` unless ``overwrite``); so does
    ``progress`` (called during the save).
    """
    started = time.monotonic()
    src, target = os.fspath(source), os.fspath(dest)
    _check_single_process()
    if is_remote(src):
        raise InvalidArgumentError(f"import reads a local file or folder, not {src!r}; download it first")
    if os.path.isdir(src):
        if os.path.exists(os.path.join(src, MANIFEST_NAME)):
            raise InvalidArgumentError(f"{src} is already a shardsafe checkpoint; load it with shardsafe.load")
        if not os.path.isfile(os.path.join(src, DCP_METADATA)):
            raise CheckpointNotFoundError(
                f"{src} is a folder without {DCP_METADATA}: not a DCP checkpoint (nor a torch.save file)"
            )
        if not is_remote(target) and inside(target, src):
            raise InvalidArgumentError(f"{target} lies inside the source {src}; import to a path outside it")
        fmt, state = "dcp", _read_dcp(src, allow_pickle)
    elif os.path.isfile(src):
        fmt, state = "torch.save", _read_torch(src, allow_pickle)
    else:
        raise CheckpointNotFoundError(f"{src} does not exist; give a torch.save file or a DCP checkpoint folder")
    wrapped = not _plain_keys(state)
    entries: dict[str, Any] = {WRAP_KEY: state} if wrapped else dict(state)
    api.save(
        target,
        entries,
        overwrite=overwrite,
        timeout=timeout,
        metadata={"imported_from": os.path.abspath(src), "source_format": fmt},
        allow_pickle=allow_pickle,
        progress=progress,
    )
    summary = api.verify(target)
    logger.info(
        "shardsafe: imported %s (%s) as %s: %d tensors, %.1f MiB verified, %.2fs",
        src,
        fmt,
        target,
        summary.tensors,
        summary.bytes / 2**20,
        time.monotonic() - started,
    )
    return ImportResult(
        path=target,
        source=src,
        source_format=fmt,
        keys=list(entries),
        tensors=summary.tensors,
        bytes=summary.bytes,
        wrapped=wrapped,
    )


def _check_single_process() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise CheckpointError(
            "import_checkpoint runs in one process, but a process group of "
            f"{dist.get_world_size()} ranks is initialised; run it outside the distributed job "
            "(e.g. `shardsafe import SRC DEST`)"
        )


def _plain_keys(state: Any) -> bool:
    return (
        isinstance(state, Mapping) and len(state) > 0 and all(isinstance(k, str) and k and "/" not in k for k in state)
    )


def _read_torch(path: str, allow_pickle: bool) -> Any:
    """The object in a ``torch.save`` file, tensors on the CPU (memory-mapped when the file allows)."""
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=not allow_pickle, mmap=True)
        except RuntimeError as err:
            if "mmap" not in str(err):
                raise
            return torch.load(path, map_location="cpu", weights_only=not allow_pickle)  # legacy format
    except pickle.UnpicklingError as err:
        if allow_pickle:
            raise CheckpointError(f"{path}: not a readable torch.save file ({err})") from err
        raise UnsafeValueError(
            f"{path}: refused: weights_only loading cannot read this file (torch said: {_first_line(err)}). If it "
            "is a torch.save file from an author you trust, allow_pickle=True (--allow-pickle) reads it with full "
            "unpickling, which runs code chosen by whoever wrote the file"
        ) from None
    except (RuntimeError, EOFError, OSError) as err:
        raise CheckpointError(f"{path}: not a readable torch.save file ({type(err).__name__}: {err})") from err


def _read_dcp(path: str, allow_pickle: bool) -> dict[str, Any]:
    """Every tensor and value of a DCP checkpoint, whole, nested as it was saved (one process)."""
    if not allow_pickle:
        raise UnsafeValueError(
            f"{path}: refused: a DCP checkpoint keeps its metadata ({DCP_METADATA}) as a pickle, and reading it "
            "would run code chosen by whoever wrote the folder. Pass allow_pickle=True (--allow-pickle) only if "
            "you trust its author"
        )
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    try:
        # What DCP's own dcp_to_torch_save does: a planner that rebuilds the whole state from the metadata
        # (the public dcp.load fills a copy of the dict it is given, which stays empty here).
        planner = _EmptyStateDictLoadPlanner()  # type: ignore[no-untyped-call]
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            _load_state_dict(state, storage_reader=FileSystemReader(path), planner=planner, no_dist=True)
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError, CheckpointException) as err:
        # DCP's CheckpointException derives from BaseException: turned into an ordinary error here
        raise CheckpointError(f"{path}: cannot read the DCP checkpoint ({type(err).__name__}: {err})") from err
    return state


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    useful = [line for line in lines if "Unsupported" in line or "global" in line.lower()]
    return (useful or lines or [type(err).__name__])[0][:300]
