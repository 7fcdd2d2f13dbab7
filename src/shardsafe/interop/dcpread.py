"""Reading a DCP (``torch.distributed.checkpoint``) folder as hostile input, in one process.

DCP keeps its metadata (``.metadata``) as a plain pickle, so a DCP folder is read only with
``allow_pickle``: that trusts the author's code, not the integrity of the copy. So DCP's own planner
rebuilds the state from the metadata (what DCP's ``dcp_to_torch_save`` does), but only after the
metadata is checked against the folder: every file it names is a plain name of a regular file in the
folder (a FIFO is refused, never opened for reading), every item's byte range lies inside its file, and
the tensors it declares (which the planner allocates) fit the bound of 2 x the data files' size + 64 MiB.
The items' bytes are read by this module instead of DCP's reader: each item is a torch.save file, read
by interop/torchread.py (every zip record's CRC-32 checked, sizes bounded; tensors weights-only).

The whole read runs on a daemon thread under a deadline (:func:`read`): a file that never answers
raises instead of hanging the import.
"""

from __future__ import annotations

import io
import os
import pickle
import stat
import threading
import warnings
from typing import Any

import torch

from shardsafe.errors import (
    CheckpointError,
    CheckpointTimeoutError,
    CorruptCheckpointError,
    UnsafePathError,
    UnsupportedCheckpointError,
)
from shardsafe.interop.torchread import Source, bound, open_regular
from shardsafe.interop.torchread import read as read_torch
from shardsafe.interop.unpickle import _Malformed, check_stream

METADATA = ".metadata"
MAX_METADATA = 1 << 30


def read_slice(src: Source, allow_pickle: bool) -> Any:
    """One item of a DCP data file: a torch.save file inside it."""
    return read_torch(src, allow_pickle)


def read(path: str, timeout: float) -> dict[str, Any]:
    """Every tensor and value of the DCP checkpoint ``path``, whole, nested as it was saved; the read
    runs on a daemon thread and is abandoned after ``timeout`` seconds (:class:`CheckpointError`)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["state"] = _read(path)
        except BaseException as err:  # handed to the caller's thread, whatever it is
            box["error"] = err

    thread = threading.Thread(target=run, name="shardsafe-import-dcp", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise CheckpointTimeoutError(
            f"{path}: reading the DCP checkpoint did not finish within {timeout:g}s (a file that never answers, or "
            "storage far too slow); nothing was imported. Raise timeout= or SHARDSAFE_IO_TIMEOUT if it is merely slow"
        )
    if "error" in box:
        err = _inner(box["error"])
        if isinstance(err, CheckpointError) or not isinstance(err, Exception):
            raise err  # the reader's own refusal as it is; KeyboardInterrupt and the like are not ours to rename
        raise CorruptCheckpointError(
            f"{path}: cannot read the DCP checkpoint ({type(err).__name__}: {str(err)[:300]}); nothing was imported"
        ) from err
    return box["state"]  # type: ignore[no-any-return]


def _inner(err: BaseException) -> BaseException:
    """DCP wraps a reader's exception in a ``CheckpointException`` (a BaseException): the one inside."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict):
        for value in failures.values():
            inner = value[0] if isinstance(value, tuple) and value else value
            if isinstance(inner, BaseException):
                return inner
    return err


def _read(path: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    class Planner(_EmptyStateDictLoadPlanner):  # type: ignore[misc]
        def set_value(self, item: Any, value: Any) -> None:
            """What ``load_bytes`` does, with the value this module read (never torch.load of the bytes)."""
            from torch.distributed.checkpoint._traverse import set_element

            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[item.dest_index.fqn], value)
            else:
                self.state_dict[item.dest_index.fqn] = value

    metadata = _metadata(path)  # read and checked here, so that DCP never logs its own failure to read it

    class Reader(FileSystemReader):  # type: ignore[misc]
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            try:
                from torch.distributed.checkpoint.metadata import StorageMeta

                if getattr(metadata, "storage_meta", None) is None:
                    metadata.storage_meta = StorageMeta()
                metadata.storage_meta.load_id = getattr(self, "load_id", None)
            except ImportError:  # torch before storage_meta
                pass
            return metadata

        def read_data(self, plan: Any, planner: Any) -> torch.futures.Future[None]:
            per_file: dict[str, list[Any]] = {}
            for item in plan.items:
                per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
            for name, items in per_file.items():
                fd = open_regular(os.path.join(path, name), "DCP data file")
                try:
                    for item in items:
                        _item(path, name, fd, self.storage_data[item.storage_index], item, planner, LoadItemType)
                finally:
                    os.close(fd)
            done: torch.futures.Future[None] = torch.futures.Future()
            done.set_result(None)
            return done

    state: dict[str, Any] = {}
    planner = Planner()  # type: ignore[no-untyped-call]
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        _load_state_dict(state, storage_reader=Reader(path), planner=planner, no_dist=True)
    return state


def _item(path: str, name: str, fd: int, info: Any, item: Any, planner: Any, kinds: Any) -> None:
    where = (
        f"{os.path.join(path, name)} (item {item.storage_index.fqn!r}, bytes {info.offset}-{info.offset + info.length})"
    )
    src = Source(fd, info.offset, info.length, where)
    if item.type == kinds.BYTE_IO:
        planner.set_value(item, read_slice(src, True))
        return
    tensor = read_slice(src, False)
    if not isinstance(tensor, torch.Tensor):
        raise CorruptCheckpointError(f"{where}: holds a {type(tensor).__name__} where the metadata says a tensor")
    for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
        tensor = tensor.narrow(dim, offset, length)
    target = planner.resolve_tensor(item).detach()
    if target.shape != tensor.shape or target.dtype != tensor.dtype:
        raise CorruptCheckpointError(
            f"{where}: holds a {list(tensor.shape)} {tensor.dtype} tensor where the metadata says "
            f"{list(target.shape)} {target.dtype}"
        )
    target.copy_(tensor)
    planner.commit_tensor(item, target)


def _metadata(path: str) -> Any:
    """The folder's metadata, unpickled (allowed), after its file was found regular and of sane size;
    then checked against the folder (:func:`_check`)."""
    file = os.path.join(path, METADATA)
    fd = open_regular(file, "DCP metadata (.metadata)")
    try:
        size = os.fstat(fd).st_size
        if size > MAX_METADATA:
            raise CorruptCheckpointError(f"{file}: {size} bytes of metadata: refused")
        raw = Source(fd, 0, size, file).pread(size, 0)
    finally:
        os.close(fd)
    try:
        check_stream(io.BytesIO(raw), f"{file}")
        metadata = pickle.loads(raw)
    except _Malformed as err:
        raise CorruptCheckpointError(f"{err}: damaged; nothing was imported") from err
    except Exception as err:
        raise CorruptCheckpointError(
            f"{file}: not a readable DCP metadata pickle ({type(err).__name__}: {err})"
        ) from err
    _check(path, metadata)
    return metadata


def _check(path: str, md: Any) -> None:
    """The metadata names only regular files of the folder, byte ranges inside them, and tensors within
    the bound; anything else is damage."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

    where = os.path.join(path, METADATA)
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise CorruptCheckpointError(f"{where}: not DCP metadata (a {type(md).__name__})")
    if not isinstance(md.storage_data, dict):
        raise CorruptCheckpointError(f"{where}: its storage_data is a {type(md.storage_data).__name__}")
    sizes: dict[str, int] = {}
    for index, info in md.storage_data.items():
        name, offset, length = info.relative_path, info.offset, info.length
        if not (isinstance(name, str) and name and "/" not in name and name not in (".", "..", METADATA)):
            raise CorruptCheckpointError(f"{where}: item {index!r} names file {name!r}, not a file of the folder")
        if getattr(info, "transform_descriptors", None):
            raise UnsupportedCheckpointError(
                f"{where}: item {index!r} is stored transformed ({info.transform_descriptors}), which the importer "
                "does not read; load the checkpoint with DCP and save it again without transforms"
            )
        if name not in sizes:
            try:
                st = os.stat(os.path.join(path, name))
            except OSError as err:
                raise CorruptCheckpointError(f"{os.path.join(path, name)}: a DCP data file is missing ({err})") from err
            if not stat.S_ISREG(st.st_mode):
                raise UnsafePathError(
                    f"{os.path.join(path, name)}: the DCP data file is not a regular file: refused, nothing was read. "
                    "An import reads regular files only"
                )
            sizes[name] = st.st_size
        if not (_count(offset) and _count(length) and offset + length <= sizes[name]):
            raise CorruptCheckpointError(
                f"{where}: item {index!r} lies at bytes {offset}+{length} of {name}, which holds {sizes[name]}"
            )
    declared, largest = 0, ("", 0)
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            continue
        if not isinstance(entry, TensorStorageMetadata) or not isinstance(entry.properties.dtype, torch.dtype):
            raise CorruptCheckpointError(f"{where}: entry {fqn!r} is neither a tensor nor bytes")
        shape = entry.size
        if not (isinstance(shape, (tuple, list)) and len(shape) <= 64 and all(_count(v) for v in shape)):
            raise CorruptCheckpointError(f"{where}: tensor {fqn!r} has size {shape!r}")
        nbytes = 1
        for v in shape:
            nbytes *= v
        nbytes *= entry.properties.dtype.itemsize
        declared += nbytes
        largest = max(largest, (str(fqn), nbytes), key=lambda x: x[1])
    limit = bound(sum(sizes.values()))
    if declared > limit:
        raise CorruptCheckpointError(
            f"{where}: the metadata declares {declared} bytes of tensors (the largest, {largest[0]!r}: {largest[1]} "
            f"bytes), more than the importer's bound of 2 x the data files' size + 64 MiB ({limit} bytes): "
            "damaged or crafted; nothing was allocated or imported"
        )


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**62
