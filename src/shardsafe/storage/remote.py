"""Object stores and any other fsspec filesystem behind :class:`~shardsafe.storage.base.Storage`.

Paths are URLs (``s3://bucket/run/step-1``, ``memory://...``, ``file://...``); fsspec is imported
here only, and only when such a path is used. The commit rule holds without a directory rename:

- data objects are written straight into the target prefix under names unique to the save
  (``data-<rank>-<saveid>.safetensors``), so a save never replaces an object a manifest points to;
- ``MANIFEST.json`` is uploaded last, whole, in one PUT: a prefix without it is not a checkpoint, and
  an overwrite replaces it atomically while the old data objects stay until they are unreferenced;
- a failed save's objects are known by its save id and deleted (through
  :mod:`shardsafe.catalog.delete`, like every delete), its unfinished multipart uploads aborted;
  objects a committed manifest references are never touched.

Every request goes through :mod:`shardsafe.storage.retry` (backoff and a deadline for throttling,
resets and 5xx). On S3 (``s3fs``) large data files upload as parallel multipart parts
(:mod:`shardsafe.storage.uploads`); other filesystems stream through ``fs.open``.
"""

from __future__ import annotations

import copy
import errno
import functools
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import wait as futures_wait
from typing import Any, TypeVar

from shardsafe import knobs
from shardsafe.deadline import NEVER, Deadline
from shardsafe.errors import CorruptCheckpointError, InvalidArgumentError, RemoteIOError
from shardsafe.storage import conditional, regular, retry
from shardsafe.storage.base import MANIFEST_NAME, Commit, PublishRefusedError, Writer, missing_files
from shardsafe.storage.fsspec_util import (
    bound_s3_retries,
    check_name,
    import_fsspec,
    local_dir,
    mtime_of,
    s3_client_options,
)
from shardsafe.storage.local import LocalStorage, fsync_dir, make_dirs, unlink_regular
from shardsafe.storage.uploads import (
    PartWriter,
    StreamWriter,
    abort_upload,
    get_with_etag,
    is_s3,
    list_uploads,
    part_bytes,
    precondition_failed,
    s3_call,
)
from shardsafe.workers import Pool, run_bounded

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Object stores have no directories: nothing to create before writing (and creating a "directory"
# with s3fs at a bucket path would create a bucket).
_OBJECT_STORE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "oci", "r2"})


class FsspecStorage:
    """:class:`~shardsafe.storage.base.Storage` over an fsspec filesystem (object stores, memory, ...).

    ``FsspecStorage("s3", {"key": ..., "client_kwargs": {"endpoint_url": ...}})`` or
    ``FsspecStorage(fs_instance)``; :meth:`for_path` picks the filesystem from a URL. ``deadline``: the
    call's, whose length bounds the S3 client's own timeouts and retries
    (:func:`~shardsafe.storage.fsspec_util.s3_client_options`)."""

    def __init__(
        self,
        protocol_or_fs: Any,
        storage_options: Mapping[str, Any] | None = None,
        *,
        policy: retry.RetryPolicy | None = None,
        deadline: Deadline | None = None,
    ) -> None:
        if isinstance(protocol_or_fs, str):
            fsspec = import_fsspec()
            try:
                options = dict(storage_options or {})
                s3 = is_s3(fsspec.get_filesystem_class(protocol_or_fs))
                if s3:
                    options = s3_client_options(options, None if deadline is None else deadline.seconds)
                self.fs = fsspec.filesystem(protocol_or_fs, **options)
                if s3:
                    bound_s3_retries(self.fs)
            except ImportError as err:
                extra = "s3" if protocol_or_fs in ("s3", "s3a") else "remote"
                raise ImportError(
                    f"{protocol_or_fs}:// needs a package fsspec lacks ({err}); pip install 'shardsafe[{extra}]'"
                ) from err
        else:
            if storage_options:
                raise InvalidArgumentError(
                    "storage_options= applies when a protocol is given, not a filesystem instance"
                )
            self.fs = protocol_or_fs
        self.policy = policy or retry.RetryPolicy.from_env()
        self.deadline: Deadline | None = deadline
        self.s3 = is_s3(self.fs)
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        self.object_store = self.s3 or bool(_OBJECT_STORE_PROTOCOLS.intersection(protocols))

    @classmethod
    def for_path(
        cls, path: str, storage_options: Mapping[str, Any] | None = None, *, deadline: Deadline | None = None
    ) -> FsspecStorage:
        """The storage for a URL such as ``s3://bucket/run/step-1``; ``storage_options`` are the
        filesystem's usual options (credentials, ``client_kwargs={"endpoint_url": ...}``); ``deadline``:
        the call's (see the class)."""
        if "::" in path:
            raise InvalidArgumentError(
                f"{path!r}: chained fsspec URLs are not supported; give the URL of the store itself"
            )
        protocol, sep, _ = path.partition("://")
        if not sep or not protocol:
            raise InvalidArgumentError(f"{path!r} has no scheme; plain paths use the local storage")
        return cls(protocol, storage_options, deadline=deadline)

    # -- paths -----------------------------------------------------------------------------------

    def _p(self, path: str) -> str:
        return str(self.fs._strip_protocol(path)).rstrip("/")

    def _key(self, target: str) -> str:
        return f"{type(self.fs).__name__}:{self._p(target)}"

    def _retry(self, op: str, path: str, fn: Callable[[], T]) -> T:
        return retry.call(op, path, fn, self.policy, self.deadline)

    def join(self, base: str, name: str) -> str:
        check_name(name, base)
        return f"{base.rstrip('/')}/{name}"

    # -- save ------------------------------------------------------------------------------------

    def within(self, deadline: Deadline | None) -> FsspecStorage:
        """This storage (the same filesystem object) bounded by ``deadline`` (``None``: none): it bounds
        the local writes and fsyncs of the save path (``file://``) and every request to an object store
        (each attempt is cut at the deadline and no retry starts past it)."""
        bound = copy.copy(self)
        bound.deadline = deadline
        return bound

    def pending_dir(self, target: str, save_id: str) -> str:
        """(rank 0 and writers) ``target`` itself: data object names carry the save id."""
        return target

    def prepare_pending(self, pending: str, marker: str = "") -> None:
        """(rank 0) Directories where there are any (``file://``: made durable); then the empty in-flight
        ``marker`` in the target (on S3 with ``If-None-Match: *``, the store's conditional writes
        checked the first time: :func:`~shardsafe.storage.conditional.put_marker`)."""
        local = None if self.object_store else local_dir(self.fs, self._p(pending))
        if local:
            run_bounded("creating the target directory", pending, self.deadline or NEVER, lambda: make_dirs(local))
        elif not self.object_store:
            self._retry("create directory", pending, lambda: self.fs.makedirs(self._p(pending), exist_ok=True))
        if not marker:
            return
        url = self.join(pending, marker)
        if self.s3:
            bucket, key, _ = self.fs.split_path(self._p(url))
            conditional.put_marker(self.fs, bucket, key, url, self.policy, self.deadline)
            self.fs.invalidate_cache(self._p(pending))
        elif local:
            self._local().stamp(self._p(url))
        else:
            self._retry("write the in-flight marker", url, lambda: self.fs.pipe_file(self._p(url), b""))

    def open_writer(self, path: str) -> Writer:
        """(writing ranks) A new data object; ``FileExistsError`` if one is there already."""
        p = self._p(path)
        if self._exists(p, path):
            raise FileExistsError(f"{path} already exists; data objects are never overwritten")
        if self.s3:
            return PartWriter(self.fs, p, path, self.policy, self.deadline)
        return StreamWriter(self.fs, p, self.deadline if local_dir(self.fs, p) else None)

    def stage_manifest(self, commit: Commit) -> None:
        """(rank 0, before the decision) Object stores: nothing (the manifest goes up in one PUT when
        published). Elsewhere: ``.MANIFEST.json.tmp-<saveid>`` in the target, durable, renamed over
        ``MANIFEST.json`` when published."""
        if self.object_store:
            return
        tmp = self._p(self.join(commit.target, commit.temp_manifest))
        writer = StreamWriter(self.fs, tmp, self.deadline if local_dir(self.fs, tmp) else None)
        try:
            writer.write(memoryview(commit.manifest))
        except BaseException:
            writer.abort()
            raise
        writer.close()

    def publish(self, commit: Commit, *, overwrite: bool, at_commit: Callable[[], None]) -> bytes | None:
        """(rank 0, after it won the commit decision, every data object durable) Make ``MANIFEST.json``
        visible: one PUT on object stores, the rename of the staged temporary file elsewhere (the
        directory fsynced around it on a local disk). Returns the manifest it replaced."""
        target = commit.target
        url = self.join(target, MANIFEST_NAME)
        p = self._p(url)
        if is_s3(self.fs):
            return self._publish_conditional(commit, url, p, overwrite=overwrite, at_commit=at_commit)
        old = self.read_bytes(url) if self._exists(p, url) else None
        if old is not None and not overwrite:
            raise FileExistsError(f"{url} exists: {target} holds a committed checkpoint; pass overwrite=True")
        local = local_dir(self.fs, self._p(target))
        if local:
            fsync_dir(local)  # the data files' entries are durable before the manifest names them
        self._check_files(commit)
        at_commit()
        if self.object_store:
            self._retry("upload manifest", url, lambda: self.fs.pipe_file(p, commit.manifest))
        else:
            tmp = self._p(self.join(target, commit.temp_manifest))
            self._retry("rename manifest", url, lambda: self.fs.mv(tmp, p))
            if local:
                fsync_dir(local)
        return old

    def _publish_conditional(
        self, commit: Commit, url: str, p: str, *, overwrite: bool, at_commit: Callable[[], None]
    ) -> bytes | None:
        """S3: the manifest PUT is conditional on the manifest this save replaces, read here with its
        ETag: ``If-Match`` that ETag (an overwrite) or ``If-None-Match: *`` (a new checkpoint). A copy of
        this request that the network delivers late (after a retry committed, and a later save replaced
        the manifest and deleted the objects it no longer lists) is refused by the store (412), so it can
        never put back a manifest whose data is gone, nor an older manifest over a newer one. A 412 seen
        here means either an earlier attempt of this very request landed and its reply was lost (the
        manifest in place is this one: committed), or another save replaced the manifest meanwhile
        (this save did not commit: ``FileExistsError``)."""
        bucket, key, _ = self.fs.split_path(p)
        old, etag = self._manifest_and_etag(url, bucket, key)
        if old is not None and not overwrite:
            raise FileExistsError(f"{url} exists: {commit.target} holds a committed checkpoint; pass overwrite=True")
        self._check_files(commit)
        at_commit()
        condition = {"IfMatch": etag} if etag is not None else {"IfNoneMatch": "*"}
        attempts: list[BaseException | None] = []

        def put() -> Any:
            attempts.append(None)  # until it ends: an attempt abandoned at the deadline may still land
            try:
                return s3_call(self.fs, "put_object", Bucket=bucket, Key=key, Body=commit.manifest, **condition)
            except BaseException as failed:
                attempts[-1] = failed
                raise

        try:
            self._retry("upload manifest", url, put)
        except OSError as err:
            if not precondition_failed(err):
                if conditional.definite_refusal(attempts, err):
                    status, code = retry.http_answer(err)
                    raise PublishRefusedError(
                        err.errno or errno.EIO,
                        f"the store refused the manifest PUT of {url} (HTTP {status} {code}: {err}) on every attempt, "
                        "so it was not written and no copy of it can land later",
                        url,
                    ) from err
                raise
            now, _ = self._manifest_and_etag(url, bucket, key)  # 412: whose manifest is there?
            if now != commit.manifest:
                raise FileExistsError(
                    errno.EEXIST,
                    f"{url} was replaced by another save while this one published it (the store refused this "
                    "save's conditional PUT): this save did not commit, the other one stands. Give each job "
                    "its own path",
                    url,
                ) from None
        self.fs.invalidate_cache(p)
        return old

    def _local(self) -> LocalStorage:
        """The local backend under this one's deadline, for what ``file://`` does with ``os`` calls."""
        return LocalStorage(self.deadline)

    def _check_files(self, commit: Commit) -> None:
        """(rank 0, publishing) Every data file of ``commit`` is in its target (one listing, no byte
        read): one removed meanwhile (a sweep of leftovers by another process, for a save that ran past
        the leftover age) raises ``FileNotFoundError`` before the commit point."""
        missing = sorted(commit.data_files.difference(self.list_dir(commit.target)))
        if missing:
            raise missing_files(commit.target, missing)

    def _manifest_and_etag(self, url: str, bucket: str, key: str) -> tuple[bytes | None, str | None]:
        """The manifest at ``url`` and its ETag, read in one GET (``None, None`` where there is none)."""
        try:
            return self._retry("read manifest", url, functools.partial(get_with_etag, self.fs, bucket, key))
        except FileNotFoundError:
            return None, None

    # -- primitives of shardsafe.catalog.delete ----------------------------------------------------

    def unlink_names(self, directory: str, names: list[str]) -> list[str]:
        """Delete ``names`` under ``directory``; missing ones are fine, any other failure raises. On a
        local disk (``file://``) only regular files go (the others are returned); an object store holds
        nothing else."""
        for n in names:
            check_name(n, directory)
        local = local_dir(self.fs, self._p(directory))
        if local:
            kept = unlink_regular(local, list(names))
            self.fs.invalidate_cache(self._p(directory))
            return kept
        self._remove_paths(directory, [self._p(self.join(directory, n)) for n in names])
        return []

    def sync_dir(self, directory: str) -> None:
        local = local_dir(self.fs, self._p(directory))
        if local:
            try:
                fsync_dir(local)
            except FileNotFoundError:
                pass

    def retire_manifest(self, path: str, tombstone: str) -> None:
        """Rename on a filesystem; on an object store the tombstone is written first, then the
        manifest deleted (between the two, the checkpoint is still committed)."""
        url, tomb = self.join(path, MANIFEST_NAME), self.join(path, tombstone)
        if self.object_store:
            raw = self.read_bytes(url)
            self._retry("write tombstone", tomb, lambda: self.fs.pipe_file(self._p(tomb), raw))
            self._remove_paths(path, [self._p(url)])
            return
        self._retry("rename manifest", url, lambda: self.fs.mv(self._p(url), self._p(tomb)))

    def remove_dir_if_empty(self, path: str) -> bool:
        if self.object_store:
            return True  # a prefix without objects does not exist
        if self._entries(path):
            return False
        try:
            self._retry("remove directory", path, lambda: self.fs.rmdir(self._p(path)))
        except FileNotFoundError:
            return True
        local = local_dir(self.fs, self._p(path))
        if local:
            fsync_dir(local.rstrip("/").rsplit("/", 1)[0] or "/")
        return True

    def cancel_uploads(self, target: str, save_id: str) -> None:
        """Abort the unfinished multipart uploads of save ``save_id`` under ``target`` (S3)."""
        if not self.s3:
            return
        prefix = self._p(target) + "/"
        for key_path, upload_id in list_uploads(self.fs, prefix, self.policy, self.deadline):
            if save_id in key_path.rsplit("/", 1)[-1]:
                abort_upload(self.fs, key_path, upload_id, self.policy, self.deadline)

    def _remove_paths(self, directory: str, paths: list[str]) -> None:
        if not paths:
            return
        if self.s3:
            bucket = self.fs.split_path(paths[0])[0]
            for i in range(0, len(paths), 1000):
                batch = paths[i : i + 1000]
                keys = [{"Key": self.fs.split_path(p)[1]} for p in batch]
                delete = functools.partial(s3_call, self.fs, "delete_objects", Bucket=bucket, Delete={"Objects": keys})
                out = self._retry("delete objects", directory, delete)
                errors = out.get("Errors") or []
                if errors:
                    detail = ", ".join(f"{e.get('Key')}: {e.get('Code')} {e.get('Message')}" for e in errors[:5])
                    raise OSError(f"deleting under {directory} failed for {len(errors)} objects: {detail}")
            self.fs.invalidate_cache(self._p(directory))
            return
        for p in paths:
            try:
                self._retry("delete", p, functools.partial(self.fs.rm_file, p))
            except FileNotFoundError:
                pass

    # -- load ------------------------------------------------------------------------------------

    def read_bytes(self, path: str, limit: int | None = None) -> bytes:
        """The content of an object (a regular file elsewhere) of at most ``limit`` bytes (default
        ``SHARDSAFE_MAX_MANIFEST_BYTES``), checked with a stat before any byte is read."""
        limit = knobs.max_manifest_bytes() if limit is None else limit
        p = self._p(path)
        size = self._file_size(path)
        if size > limit:
            raise CorruptCheckpointError(
                f"{path}: {size} bytes, more than the {limit} allowed; if it is genuine, raise "
                "SHARDSAFE_MAX_MANIFEST_BYTES"
            )
        if size == 0:
            return b""  # a ranged GET of an empty object is refused (416)
        data = bytes(self._retry("read", path, lambda: self.fs.cat_file(p, start=0, end=limit + 1)))
        if len(data) > limit:
            raise CorruptCheckpointError(f"{path}: grew past {limit} bytes while being read")
        return data

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        """Ranged reads of ``[offset, offset + len(out))`` only; large ranges are split into parts
        read in parallel. ``EOFError`` if the object is shorter. Outside object stores (``file://``,
        ``memory://``, ...) the path must be a regular file, checked first."""
        out = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        if not 0 <= offset <= offset + len(out) < 2**63:
            raise EOFError(f"{path}: byte range at {offset} of {len(out)} bytes lies past any file's end")
        if not self.object_store:
            self._file_size(path)
        p = self._p(path)
        step = part_bytes()
        spans = [(s, min(len(out), s + step)) for s in range(0, len(out), step)]
        if len(spans) <= 1:
            for s, e in spans:
                self._read_span(p, path, offset, out, s, e)
            return
        pool = Pool(min(len(spans), knobs.remote_read_threads()), "remote-read")  # daemon threads
        futures = [pool.submit(self._read_span, p, path, offset, out, s, e) for s, e in spans]
        try:
            for f in futures:
                f.result()  # re-raises a reader thread's error here (each request is bounded by the deadline)
        finally:
            pool.shutdown(wait=False, cancel=True)
            # after a failure, the spans still running end (each bounded) before ``out`` is handed back
            futures_wait(futures, timeout=(self.deadline or NEVER).remaining())

    def _stat(self, path: str) -> dict[str, Any]:
        """``fs.info`` of ``path``; on the local filesystem anything but a directory must also pass
        :func:`~shardsafe.storage.regular.stat_regular` (no FIFO, device, loop or symlink out)."""
        info = regular.no_loop(path, lambda: self._info(path))
        local = local_dir(self.fs, self._p(path))
        if local is not None and info.get("type") != "directory":
            regular.stat_regular(local)
        return info

    def _file_size(self, path: str) -> int:
        """Size of ``path``, which must be a file (an object), never a directory or prefix."""
        info = self._stat(path)
        if info.get("type") != "file":
            raise CorruptCheckpointError(f"{path} is not a regular file ({info.get('type')}); expected an object")
        return int(info["size"])

    def _read_span(self, p: str, url: str, offset: int, out: memoryview, start: int, end: int) -> None:
        lo, hi = offset + start, offset + end
        try:
            data = self._retry(f"read bytes {lo}-{hi}", url, lambda: self.fs.cat_file(p, start=lo, end=hi))
        except (FileNotFoundError, RemoteIOError):
            raise
        except OSError as err:  # S3 answers a range past the end with 416
            if self.size(url) < hi:
                raise EOFError(f"{url}: ends before byte {hi} (truncated)") from err
            raise
        if len(data) != hi - lo:
            raise EOFError(f"{url}: ends before byte {hi} (got {len(data)} of {hi - lo} bytes at {lo}; truncated)")
        out[start:end] = data

    def size(self, path: str) -> int:
        """Bytes of an object, or of the objects directly inside a prefix (for the manager's listing).
        ``FileNotFoundError``; :class:`CorruptCheckpointError` for what is neither (a FIFO, a device,
        a symlink loop or out of its directory on a local filesystem)."""
        info = self._stat(path)
        if info.get("type") == "directory":
            return sum(int(e.get("size") or 0) for e in self._entries(path) if e.get("type") != "directory")
        if info.get("type") != "file":
            raise CorruptCheckpointError(f"{path} is not a regular file ({info.get('type')}); expected an object")
        return int(info["size"])

    def total_size(self, path: str) -> int:
        """As :meth:`size`, which counts the objects directly inside a prefix too."""
        return self.size(path)

    def _info(self, path: str) -> dict[str, Any]:
        p = self._p(path)
        self.fs.invalidate_cache(p)
        return dict(self._retry("stat", path, lambda: self.fs.info(p)))

    def _entries(self, path: str) -> list[dict[str, Any]]:
        p = self._p(path)
        self.fs.invalidate_cache(p)
        try:
            entries = self._retry("list", path, lambda: self.fs.ls(p, detail=True))
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [dict(e) for e in entries if str(e["name"]).rstrip("/") != p]

    def is_dir(self, path: str) -> bool:
        """Whether ``path`` is a prefix (object stores) or directory holding something."""
        try:
            return self._info(path).get("type") == "directory"
        except FileNotFoundError:
            return False

    def mtime(self, path: str) -> float:
        """Last change (unix time) of an object, or of the newest object directly inside a prefix.
        ``FileNotFoundError`` when there is nothing."""
        info = self._info(path)
        times = [mtime_of(info)]
        if info.get("type") == "directory":
            times += [mtime_of(e) for e in self._entries(path)]
        known = [t for t in times if t is not None]
        if not known:
            raise FileNotFoundError(f"{path}: the store reports no modification time for it or its objects")
        return max(known)

    def exists(self, path: str) -> bool:
        return self._exists(self._p(path), path)

    def _exists(self, p: str, url: str) -> bool:
        self.fs.invalidate_cache(p)  # another rank or process may have written it since we listed
        return bool(self._retry("stat", url, lambda: self.fs.exists(p)))

    def list_dir(self, path: str) -> list[str]:
        """Names of the objects and sub-prefixes directly under ``path``; empty when there are none."""
        return sorted({str(e["name"]).rstrip("/").rsplit("/", 1)[-1] for e in self._entries(path)})

    def entries(self, path: str) -> dict[str, str]:
        """As :meth:`list_dir`, each name with its kind: objects are files, sub-prefixes folders; on a
        local disk (``file://``) links, FIFOs and sockets are told apart too, links never followed."""
        local = local_dir(self.fs, self._p(path))
        if local:
            return LocalStorage().entries(local)
        out: dict[str, str] = {}
        for e in self._entries(path):
            name = str(e["name"]).rstrip("/").rsplit("/", 1)[-1]
            kind = "dir" if e.get("type") == "directory" else "file" if e.get("type") == "file" else "other"
            if out.get(name) != "dir":  # an object and a prefix of one name: the prefix is what shows
                out[name] = kind
        return out

    def stamp(self, path: str) -> float:
        """Create the empty object or file ``path``; its modification time as the store records it."""
        local = local_dir(self.fs, self._p(path))
        if local:
            return self._local().stamp(local)
        self._retry("write a clock probe", path, lambda: self.fs.pipe_file(self._p(path), b""))
        return self.mtime(path)
