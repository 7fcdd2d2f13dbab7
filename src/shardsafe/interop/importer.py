"""Import a ``torch.save`` file, a DCP (``torch.distributed.checkpoint``) folder or a Hugging Face
safetensors export as a verified shardsafe checkpoint. Runs in one process: the source is read whole into
memory, saved with :func:`shardsafe.save` (all-or-nothing, as every save) and then verified byte for byte.

The source is hostile input, as a checkpoint is to a load: interop/torchread.py reads torch.save files
(every zip record's CRC-32 and every declared size checked before use, pickles weights-only unless
``allow_pickle``), interop/dcpread.py DCP folders (metadata checked against the folder, regular files
only, items read as torch.save files), interop/hfread.py safetensors files. Reading runs on a daemon
thread under a deadline. Every failure is a :class:`CheckpointError` (damage: :class:`CorruptCheckpointError`;
an intact source that needs full unpickling: :class:`UnsafeValueError`). interop/resume.py gives a DCP
model and its name-keyed optimizer the kinds ``shardsafe.load`` resumes from.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shardsafe import knobs
from shardsafe.engine import api
from shardsafe.engine.guard import entry_point
from shardsafe.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    InvalidArgumentError,
    InvalidCallError,
    MissingPackageError,
    UnforeseenError,
    UnsafeValueError,
)
from shardsafe.interop import dcpread, hfread, torchread
from shardsafe.interop.outdir import inside
from shardsafe.interop.resume import shape
from shardsafe.storage import MANIFEST_NAME, is_remote

if TYPE_CHECKING:
    from shardsafe.progress.record import ProgressCallback

logger = logging.getLogger(__name__)

WRAP_KEY = "state"
"""The one top-level key a source that is not a dict of plain string keys is saved under."""
HF_KEY = "model"
"""The entry a Hugging Face export's tensors are saved under."""
DCP_METADATA = dcpread.METADATA


@dataclass(frozen=True)
class ImportResult:
    path: str  # the new checkpoint
    source: str
    source_format: str  # "torch.save", "dcp" or "safetensors"
    keys: list[str]  # its top-level entries
    tensors: int
    bytes: int  # bytes verified
    wrapped: bool  # the source was not a dict of plain string keys: saved under WRAP_KEY


@entry_point("import", reads=True)
def import_checkpoint(
    source: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    *,
    allow_pickle: bool = False,
    overwrite: bool = False,
    timeout: float | None = None,
    progress: ProgressCallback | None = None,
) -> ImportResult:
    """Save what ``source`` holds (a ``torch.save`` file, a DCP checkpoint folder, or a Hugging Face
    safetensors export: a folder with ``model.safetensors`` or ``model.safetensors.index.json``, or one
    ``.safetensors`` file) as the shardsafe checkpoint ``dest``, then verify it. One process, outside any
    distributed job.

    Nested dicts, lists and tuples of tensors and plain values keep their structure; a source that is
    a dict with string keys gives one checkpoint entry per key (else it is saved under ``"state"``); a
    Hugging Face export gives one entry, ``"model"``. A DCP optimizer keyed by parameter name (as
    ``get_state_dict`` gives it) is saved as an optimizer entry beside its model, so ``shardsafe.load``
    resumes both. Raises :class:`UnsafeValueError` when reading would unpickle arbitrary objects (a DCP
    folder, or a ``torch.save`` file that weights-only reading refuses) without ``allow_pickle=True``;
    with it, values that typed JSON cannot hold are stored as pickle (loaded back only with
    ``allow_pickle=True``). A damaged or hostile source raises :class:`CorruptCheckpointError` naming
    the file (and the record) before anything is written. ``timeout`` bounds the read of the source
    (default ``SHARDSAFE_IO_TIMEOUT``) and is passed to the save. ``dest`` follows :func:`shardsafe.save`
    (``CheckpointExistsError`` unless ``overwrite``); so does ``progress`` (called during the save).
    """
    started = time.monotonic()
    src, target = os.fspath(source), os.fspath(dest)
    _check_single_process()
    if is_remote(src):
        raise InvalidArgumentError(f"import reads a local file or folder, not {src!r}; download it first")
    deadline = knobs.io_timeout() if timeout is None else float(timeout)
    if os.path.isdir(src):
        if os.path.lexists(os.path.join(src, MANIFEST_NAME)):
            raise InvalidArgumentError(f"{src} is already a shardsafe checkpoint; load it with shardsafe.load")
        if not is_remote(target) and inside(target, src):
            raise InvalidArgumentError(f"{target} lies inside the source {src}; import to a path outside it")
        if os.path.lexists(os.path.join(src, DCP_METADATA)):
            if not allow_pickle:
                raise UnsafeValueError(
                    f"{src}: refused: a DCP checkpoint keeps its metadata ({DCP_METADATA}) as a pickle, and reading "
                    "it would run code chosen by whoever wrote the folder. Pass allow_pickle=True (--allow-pickle) "
                    "only if you trust its author"
                )
            fmt, state = "dcp", _guarded(src, lambda: dcpread.read(src, deadline))
        elif hfread.is_folder(src):
            fmt, state = "safetensors", {HF_KEY: _deadline(src, deadline, lambda: hfread.read_folder(src))}
        else:
            raise CheckpointNotFoundError(
                f"{src} is a folder, but not a DCP checkpoint (no {DCP_METADATA}) nor a Hugging Face export (no "
                f"{hfread.SINGLE} or {hfread.INDEX}): nothing to import. Give a torch.save file, a DCP folder or a "
                "Hugging Face folder"
            )
    elif os.path.lexists(src):
        fmt, state = _deadline(src, deadline, lambda: _read_file(src, allow_pickle))
    else:
        raise CheckpointNotFoundError(
            f"{src} does not exist; give a torch.save file, a DCP checkpoint folder or a Hugging Face folder"
        )
    wrapped = not _plain_keys(state)
    entries: dict[str, Any] = {WRAP_KEY: state} if wrapped else shape(dict(state), src)
    try:
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
    except CheckpointError:
        raise
    except Exception as err:  # a value the save could not take: said as the import's failure, nothing committed
        raise UnforeseenError(
            f"import of {src}: saving it as {target} failed ({type(err).__name__}: {str(err)[:300]})"
        ) from err
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


def _read_file(path: str, allow_pickle: bool) -> tuple[str, Any]:
    """(format, content) of the file ``path``: a safetensors file or a torch.save file, told by its bytes."""
    fd = torchread.open_regular(path, "source file")
    try:
        src = torchread.Source(fd, 0, os.fstat(fd).st_size, path)
        if torchread.sniff(src) == "safetensors":
            tensors = hfread.read(src)
            if os.path.basename(path) == hfread.SINGLE:  # save_pretrained's file: its config is beside it
                hfread.untie(os.path.dirname(os.path.abspath(path)), tensors)
            return "safetensors", {HF_KEY: tensors}
        return "torch.save", torchread.read(src, allow_pickle)
    finally:
        os.close(fd)


def _guarded(src: str, read: Any) -> Any:
    """``read()``, any exception but a CheckpointError reported as one naming ``src``."""
    try:
        return read()
    except CheckpointError:
        raise
    except ImportError as err:  # a package this Python lacks: said as such, never as damage
        raise MissingPackageError(
            f"{src}: reading it needs the module {err.name or str(err)[:100]!r}, which this Python cannot import "
            f"({type(err).__name__}: {str(err)[:200]}). Install the package that provides it and import again; "
            "nothing was imported"
        ) from err
    except Exception as err:
        raise UnforeseenError(f"{src}: cannot import it ({type(err).__name__}: {str(err)[:300]})") from err


def _deadline(src: str, timeout: float, read: Any) -> Any:
    """``read()`` on a daemon thread, abandoned after ``timeout`` seconds (a file that never answers)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = _guarded(src, read)
        except BaseException as err:
            box["error"] = err

    thread = threading.Thread(target=run, name="shardsafe-import-read", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise CheckpointTimeoutError(
            f"{src}: reading the source did not finish within {timeout:g}s (a file that never answers, or storage "
            "far too slow); nothing was imported. Raise timeout= or SHARDSAFE_IO_TIMEOUT if it is merely slow"
        )
    if "error" in box:
        raise box["error"]
    return box["value"]


def _check_single_process() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise InvalidCallError(
            "import_checkpoint runs in one process, but a process group of "
            f"{dist.get_world_size()} ranks is initialised; run it outside the distributed job "
            "(e.g. `shardsafe import SRC DEST`)"
        )


def _plain_keys(state: Any) -> bool:
    return (
        isinstance(state, Mapping) and len(state) > 0 and all(isinstance(k, str) and k and "/" not in k for k in state)
    )
