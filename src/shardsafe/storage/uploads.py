"""Writing one data object: parallel multipart uploads to S3 (through ``s3fs``'s client), and a
plain stream through ``fs.open`` for other fsspec filesystems.

On S3 the writer fills a part buffer from ``write`` calls (one copy, out of tensor memory) and
hands each full part to a bounded thread pool that uploads it while the next part fills, so at most
``upload_threads() + 1`` parts are in memory. Each part is retried on its own; the object appears
only when ``close`` completes the upload (a small file is one PUT instead), and ``abort`` cancels
it, so a partial object is never visible. A failure in an upload thread is raised by the next
``write`` or by ``close``.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, TypeVar

from shardsafe import knobs
from shardsafe.deadline import NEVER, Deadline
from shardsafe.storage import retry
from shardsafe.workers import Lane, Pool

logger = logging.getLogger(__name__)

T = TypeVar("T")

MIN_PART = 5 * 1024 * 1024  # S3's smallest part (all but the last)
MAX_PART = 5 * 1024 * 1024 * 1024  # and largest
MAX_PARTS = 10_000
_GROW_EVERY = 1_000  # parts; the part size doubles after each such run, so 10,000 parts hold any file


def part_bytes() -> int:
    """Bytes per uploaded part and per parallel ranged read (``SHARDSAFE_REMOTE_PART_BYTES``). S3
    refuses parts under 5 MiB (``MIN_PART``) but the last; test servers may allow smaller."""
    return knobs.remote_part_bytes()


def upload_threads() -> int:
    """Parts of one file uploaded at once (``SHARDSAFE_REMOTE_UPLOAD_THREADS``)."""
    return knobs.remote_upload_threads()


def is_s3(fs: Any) -> bool:
    """Whether ``fs`` is an ``s3fs`` filesystem (or a subclass), whose client we drive directly."""
    return callable(getattr(fs, "_call_s3", None)) and callable(getattr(fs, "split_path", None))


def s3_call(fs: Any, method: str, **kwargs: Any) -> Any:
    """One S3 API call on ``fs``'s event loop, from any thread. Goes through the instance's
    ``_call_s3`` (so a subclass that wraps it sees every request)."""
    from fsspec.asyn import sync

    return sync(fs.loop, fs._call_s3, method, **kwargs)


def precondition_failed(err: BaseException) -> bool:
    """Whether ``err`` is the store's 412 refusal of a conditional request (``If-Match`` /
    ``If-None-Match``), whatever ``s3fs`` translated it to (``FileExistsError`` or ``OSError(EINVAL)``)."""
    cur: BaseException | None = err
    for _ in range(10):
        if cur is None:
            return False
        response = getattr(cur, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code == "PreconditionFailed" or status == 412:
                return True
        cur = cur.__cause__ or cur.__context__
    return False


def get_with_etag(fs: Any, bucket: str, key: str) -> tuple[bytes, str]:
    """One GET of ``bucket/key`` on ``fs``'s event loop: its bytes and its ETag, of the same version
    (``FileNotFoundError`` when there is none)."""
    from fsspec.asyn import sync

    async def get() -> tuple[bytes, str]:
        resp = await fs._call_s3("get_object", Bucket=bucket, Key=key)
        body = resp["Body"]
        try:
            data = await body.read()
        finally:
            body.close()
        return bytes(data), str(resp["ETag"])

    result: tuple[bytes, str] = sync(fs.loop, get)
    return result


def list_uploads(
    fs: Any, prefix: str, policy: retry.RetryPolicy, deadline: Deadline | None = None
) -> list[tuple[str, str]]:
    """``(bucket/key, upload id)`` of the unfinished multipart uploads under ``prefix`` (every request
    ended by ``deadline``, see :func:`~shardsafe.storage.retry.call`)."""
    bucket, key_prefix, _ = fs.split_path(prefix)
    found: list[tuple[str, str]] = []
    markers: dict[str, str] = {}
    for _ in range(10_000):  # pages of 1,000; a bound rather than trusting IsTruncated forever
        page = functools.partial(s3_call, fs, "list_multipart_uploads", Bucket=bucket, Prefix=key_prefix, **markers)
        out = retry.call("list multipart uploads", prefix, page, policy, deadline)
        found += [(f"{bucket}/{u['Key']}", u["UploadId"]) for u in out.get("Uploads") or []]
        if not out.get("IsTruncated"):
            break
        markers = {"KeyMarker": out.get("NextKeyMarker", ""), "UploadIdMarker": out.get("NextUploadIdMarker", "")}
    return found


def abort_upload(
    fs: Any, key_path: str, upload_id: str, policy: retry.RetryPolicy, deadline: Deadline | None = None
) -> None:
    """Abort one unfinished multipart upload of ``bucket/key``; one already gone is fine."""
    bucket, key, _ = fs.split_path(key_path)
    abort = functools.partial(s3_call, fs, "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
    try:
        retry.call(f"abort multipart upload {upload_id}", key_path, abort, policy, deadline)
    except FileNotFoundError:
        pass


class PartWriter:
    """A new S3 object uploaded in parallel parts (see the module docstring). ``url`` names it in
    errors. ``write`` blocks while ``upload_threads()`` parts are in flight (bounded memory)."""

    def __init__(
        self, fs: Any, path: str, url: str, policy: retry.RetryPolicy, deadline: Deadline | None = None
    ) -> None:
        self.fs = fs
        self.url = url
        self.policy = policy
        self.deadline = deadline
        """The operation's deadline: every request of this upload is cut at it (see retry.call)."""
        self.bucket, self.key, _ = fs.split_path(path)
        self.base_part = part_bytes()
        self.fixed_size = bool(getattr(fs, "fixed_upload_size", False))
        self.threads = upload_threads()
        self.buf = bytearray(self._part_size(1))
        self.fill = 0
        self.total = 0
        self.upload_id: str | None = None
        self.parts: list[Future[dict[str, Any]]] = []
        self.pool: Pool | None = None  # daemon threads: an upload hung for good never keeps the process alive
        self.finished = False

    def _part_size(self, number: int) -> int:
        if self.fixed_size:
            return self.base_part
        return min(MAX_PART, self.base_part << ((number - 1) // _GROW_EVERY))

    def _op(self, what: str) -> str:
        return f"{what} (upload {self.upload_id})" if self.upload_id else what

    def write(self, data: memoryview) -> None:
        if self.finished:
            raise ValueError(f"{self.url}: write after close/abort")
        view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        while len(view):
            n = min(len(view), len(self.buf) - self.fill)
            self.buf[self.fill : self.fill + n] = view[:n]
            self.fill += n
            self.total += n
            view = view[n:]
            if self.fill == len(self.buf):
                self._send_part()

    def _send_part(self) -> None:
        if self.upload_id is None:

            def start() -> Any:
                return s3_call(self.fs, "create_multipart_upload", Bucket=self.bucket, Key=self.key)

            self.upload_id = retry.call("start multipart upload", self.url, start, self.policy, self.deadline)[
                "UploadId"
            ]
            self.pool = Pool(self.threads, "upload")
        self._wait_for_room(self.threads - 1)
        number = len(self.parts) + 1
        if number > MAX_PARTS:
            raise OSError(f"{self.url}: more than {MAX_PARTS} parts; raise SHARDSAFE_REMOTE_PART_BYTES")
        body, self.fill = self.buf, 0  # a bytearray: botocore takes no memoryview as a Body
        assert self.pool is not None
        self.parts.append(self.pool.submit(self._upload_part, number, body))
        self.buf = bytearray(self._part_size(number + 1))

    def _upload_part(self, number: int, body: bytearray) -> dict[str, Any]:
        out = retry.call(
            self._op(f"upload part {number}"),
            self.url,
            lambda: s3_call(
                self.fs,
                "upload_part",
                Bucket=self.bucket,
                Key=self.key,
                UploadId=self.upload_id,
                PartNumber=number,
                Body=body,
            ),
            self.policy,
            self.deadline,
        )
        return {"PartNumber": number, "ETag": out["ETag"]}

    def _wait_for_room(self, max_pending: int) -> None:
        """Block until at most ``max_pending`` parts are in flight; raise the first part failure. Each
        part's requests end by the deadline (``SHARDSAFE_IO_TIMEOUT`` without one)."""
        deadline = knobs.io_timeout() if self.deadline is None else self.deadline.remaining() + 1.0
        while True:
            pending = [f for f in self.parts if not f.done()]
            for f in self.parts:
                if f.done() and f.exception() is not None:
                    raise f.exception()  # type: ignore[misc]
            if len(pending) <= max_pending:
                return
            done, _ = wait(pending, timeout=deadline, return_when=FIRST_COMPLETED)
            if not done:
                raise TimeoutError(
                    f"{self.url}: {len(pending)} part uploads made no progress in {deadline:g}s "
                    f"(SHARDSAFE_IO_TIMEOUT); the store is stalled"
                )

    def close(self) -> None:
        """Finish the upload: the object exists, whole, when this returns."""
        if self.finished:
            raise ValueError(f"{self.url}: closed twice")
        try:
            if self.upload_id is None:
                body = self.buf
                del body[self.fill :]
                retry.call(
                    "upload",
                    self.url,
                    lambda: s3_call(self.fs, "put_object", Bucket=self.bucket, Key=self.key, Body=body),
                    self.policy,
                    self.deadline,
                )
            else:
                if self.fill:
                    del self.buf[self.fill :]
                    self._send_part()
                self._wait_for_room(0)
                self._complete([f.result() for f in self.parts])
                _cleanup(lambda: self._abort_strays(self.deadline), self.url)
            self.finished = True
            self.fs.invalidate_cache(f"{self.bucket}/{self.key}")
        except BaseException:
            _cleanup(self._cancel, self.url)
            raise
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=False)

    def _complete(self, parts: list[dict[str, Any]]) -> None:
        def complete() -> None:
            try:
                s3_call(
                    self.fs,
                    "complete_multipart_upload",
                    Bucket=self.bucket,
                    Key=self.key,
                    UploadId=self.upload_id,
                    MultipartUpload={"Parts": parts},
                )
            except FileNotFoundError:
                # NoSuchUpload: an earlier copy of this request completed it and its reply was lost (a
                # retry, ours or the client's own, or a copy the network delivered twice). The key is
                # this writer's alone: an object of the full size there is this upload, completed.
                if self._stored_size() == self.total:
                    return
                raise

        retry.call(self._op("complete multipart upload"), self.url, complete, self.policy, self.deadline)

    def _abort_strays(self, deadline: Deadline | None) -> None:
        """Abort the other uploads of this key (its name is this writer's alone): those a start created
        whose reply was lost, or that the network delivered twice. One listing, whether or not a start
        was retried: the S3 client retries on its own, unseen here."""
        key_path = f"{self.bucket}/{self.key}"
        for found, upload_id in list_uploads(self.fs, key_path, self.policy, deadline):
            if found == key_path and upload_id != self.upload_id:
                abort_upload(self.fs, found, upload_id, self.policy, deadline)

    def _stored_size(self) -> int | None:
        try:
            head = s3_call(self.fs, "head_object", Bucket=self.bucket, Key=self.key)
        except FileNotFoundError:
            return None
        return int(head["ContentLength"])

    def abort(self) -> None:
        """Cancel the upload; nothing becomes visible. Parts in flight are waited for (each is
        bounded by the deadline) so none lands after the abort; the abort's own requests end by the
        deadline, or past it run on a thread of their own within the error-reporting grace
        (``SHARDSAFE_ERROR_REPORT_SECONDS``)."""
        if self.finished:
            return
        try:
            self._cancel()
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=False)

    def _cancel(self) -> None:
        self.finished = True
        grace = None if self.deadline is None else self.deadline.or_grace()
        for f in self.parts:
            f.cancel()
        running = [f for f in self.parts if not f.done()]
        if running:
            wait(
                running,
                timeout=self.policy.deadline + knobs.wait_margin_seconds() if grace is None else grace.remaining(),
            )
        for f in self.parts:
            if f.done() and not f.cancelled() and f.exception() is not None:
                logger.debug("%s: part upload failed during abort: %s", self.url, f.exception())
        if self.upload_id is None:
            return
        upload_id = self.upload_id

        def abort() -> None:
            abort_upload(self.fs, f"{self.bucket}/{self.key}", upload_id, self.policy, grace)
            self._abort_strays(grace)

        if self.deadline is not None and self.deadline.expired():
            # Past the deadline the caller does not wait for the store once more (the save's own cleanup
            # has its grace to spend, and aborts this save's uploads too): the abort goes on, within the
            # grace, on a thread of its own.
            lane = Lane("abort")
            lane.post(lambda: _cleanup(abort, self.url))
            lane.close()
            return
        abort()


class StreamWriter:
    """A data file written through ``fs.open(path, "wb")`` (filesystems other than S3): the file
    object's own buffering uploads it; ``close`` finishes it (fsync on a local disk). Not retried
    mid-stream: a failure raises and the engine aborts the save. Every call runs on a
    :class:`~shardsafe.workers.Lane` of its own, waited for until ``deadline`` (given for a local disk:
    ``file://``; ``None``: no deadline)."""

    def __init__(self, fs: Any, path: str, deadline: Deadline | None = None) -> None:
        self.fs = fs
        self.path = path
        self.deadline = deadline or NEVER
        self.lane = Lane("write")
        try:
            self.f = self._io("create", lambda: fs.open(path, "wb"))
        except BaseException:
            self.lane.close()
            raise

    def _io(self, what: str, fn: Callable[[], T]) -> T:
        return self.lane.call(what, self.path, fn, self.deadline)

    def write(self, data: memoryview) -> None:
        self._io("write", lambda: self.f.write(data))

    def close(self) -> None:
        try:
            self._io("fsync", self._finish)
        except BaseException:
            if not self.lane.wedged:
                _cleanup(self.abort, self.path)
            raise
        finally:
            self.lane.close()

    def _finish(self) -> None:
        self.f.flush()
        raw = getattr(self.f, "f", None)  # fsspec's LocalFileOpener wraps a real file
        if raw is not None and hasattr(raw, "fileno"):
            os.fsync(raw.fileno())
        self.f.close()

    def abort(self) -> None:
        if self.lane.wedged:
            return
        self._io("abort", self._discard)
        self.lane.close()

    def _discard(self) -> None:
        from fsspec.spec import AbstractBufferedFile

        from shardsafe.storage.remote import FsspecStorage

        if isinstance(self.f, AbstractBufferedFile):
            self.f.discard()  # cancels an upload in progress where the filesystem supports it
            self.f.closed = True  # closing would commit what was written so far
        else:
            self.f.close()
        folder, _, name = self.path.rpartition("/")
        FsspecStorage(self.fs).unlink_names(folder, [name])  # the object this writer wrote, nothing else


def _cleanup(undo: Callable[[], None], url: str) -> None:
    """Undo a failed write without hiding why it failed: the caller re-raises the original error."""
    try:
        undo()
    except Exception as err:
        logger.warning("%s: could not clean up after a failed write: %s: %s", url, type(err).__name__, err)
