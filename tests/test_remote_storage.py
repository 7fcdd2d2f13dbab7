"""The fsspec backend on its own, through the Storage protocol: on a real S3 endpoint (moto on the
loopback interface, s3fs as the client), on ``memory://`` and on ``file://``; then S3's parallel
multipart uploads, the retries, and the fault-injecting filesystem proving that transient faults are
retried and that nothing partial ever becomes visible."""

# ruff: noqa: F811  (the S3 fixtures are imported from conftest_s3 and named as test parameters)

from __future__ import annotations

import errno
import json
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from shardsafe.catalog.delete import delete_checkpoint, delete_files, discard_save, stale_files
from shardsafe.catalog.names import TOMBSTONE, commit_of
from shardsafe.errors import RemoteIOError
from shardsafe.format.manifest import FileEntry, Manifest, seal_manifest
from shardsafe.storage import MANIFEST_NAME, get_storage
from shardsafe.storage.remote import FsspecStorage
from shardsafe.storage.retry import RetryPolicy, call, is_transient
from shardsafe.storage.uploads import list_uploads

from conftest_s3 import PART, FlakyS3FileSystem, s3_bucket, s3_server  # noqa: F401
from s3_server import S3Server

FAST = RetryPolicy(deadline=20.0, base_delay=0.01, max_delay=0.05)
SID_OLD, SID_NEW = "1700000000aaaa", "1700000001bbbb"


def _manifest(save_id: str, files: list[str]) -> bytes:
    """A manifest that passes the loader's validation, listing ``files`` (and holding no tensors)."""
    entries = {f: FileEntry(size=8, header_bytes=8, header_checksum="0" * 16) for f in files}
    return Manifest(save_id, 0.0, 1, "plain", {}, 1024, None, {}, {}, entries).to_bytes()


def _publish(st: FsspecStorage, target: str, save_id: str, files: list[str], *, overwrite: bool) -> bytes | None:
    raw = _manifest(save_id, files)
    commit = commit_of(target, target, save_id, raw, files)
    st.stage_manifest(commit)
    return st.publish(commit, overwrite=overwrite, at_commit=lambda: None)


def _put(st: FsspecStorage, url: str, data: bytes, piece: int = 100_000) -> None:
    w = st.open_writer(url)
    for i in range(0, len(data), piece):
        w.write(memoryview(data)[i : i + piece])
    w.close()


def _save(
    st: FsspecStorage, target: str, save_id: str, files: dict[str, bytes], *, overwrite: bool = False
) -> list[str]:
    staging = st.pending_dir(target, save_id)
    st.prepare_pending(staging)
    for name, data in files.items():
        _put(st, st.join(staging, name), data)
    old = _publish(st, target, save_id, list(files), overwrite=overwrite)
    return stale_files(old, _manifest(save_id, list(files)), target)


def _flaky(server: S3Server, plan: dict[str, list[str]] | None = None, **kw: Any) -> FsspecStorage:
    fs = FlakyS3FileSystem(plan=plan or {}, skip_instance_cache=True, **server.storage_options, **kw)
    return FsspecStorage(fs, policy=FAST)


@pytest.fixture(params=["s3", "memory", "file"])
def root(request: Any, tmp_path: Any) -> Iterator[tuple[FsspecStorage, str]]:
    """A storage and an empty root URL on it."""
    if request.param == "s3":
        server = request.getfixturevalue("s3_server")
        bucket = request.getfixturevalue("s3_bucket")
        yield FsspecStorage.for_path(f"s3://{bucket}", server.storage_options), f"s3://{bucket}/run"
    elif request.param == "memory":
        url = f"memory://t-{uuid.uuid4().hex[:8]}/run"
        st = FsspecStorage.for_path(url)
        yield st, url
        st.fs.rm(st._p(url), recursive=True)
    else:
        yield FsspecStorage.for_path(f"file://{tmp_path}"), f"file://{tmp_path}/run"


def test_write_publish_read_list(root: tuple[FsspecStorage, str]) -> None:
    st, base = root
    target = st.join(base, "step-1")
    a, b = os.urandom(250_000), os.urandom(1000)
    names = [f"data-00000-{SID_OLD}.safetensors", f"data-00001-{SID_OLD}.safetensors"]
    assert st.pending_dir(target, SID_OLD) == target  # unique names: no staging prefix needed
    st.prepare_pending(target)
    _put(st, st.join(target, names[0]), a)
    _put(st, st.join(target, names[1]), b)
    manifest_url = st.join(target, MANIFEST_NAME)
    assert not st.exists(manifest_url)  # data without a manifest: not a checkpoint yet
    assert st.list_dir(target) == names

    assert _publish(st, target, SID_OLD, names, overwrite=False) is None
    assert json.loads(st.read_bytes(manifest_url))["save_id"] == SID_OLD
    assert st.list_dir(target) == sorted([MANIFEST_NAME, *names])
    assert st.list_dir(base) == ["step-1"]
    assert st.size(st.join(target, names[0])) == len(a)
    out = bytearray(70_000)
    st.read_into(st.join(target, names[0]), 123_456, memoryview(out))
    assert bytes(out) == a[123_456 : 123_456 + 70_000]
    with pytest.raises(FileExistsError, match="overwrite=True"):
        _publish(st, target, SID_NEW, [], overwrite=False)
    with pytest.raises(FileExistsError, match="never overwritten"):
        st.open_writer(st.join(target, names[1]))


def test_overwrite_replaces_manifest_and_returns_old_files(root: tuple[FsspecStorage, str]) -> None:
    st, base = root
    target = st.join(base, "ckpt")
    old = {f"data-00000-{SID_OLD}.safetensors": b"old0", f"data-00001-{SID_OLD}.safetensors": b"old1"}
    _save(st, target, SID_OLD, old)
    new = {f"data-00000-{SID_NEW}.safetensors": b"new0"}
    stale = _save(st, target, SID_NEW, new, overwrite=True)
    assert sorted(stale) == sorted(old)
    assert json.loads(st.read_bytes(st.join(target, MANIFEST_NAME)))["save_id"] == SID_NEW
    # the old data stays until the caller removes what is unreferenced
    assert set(st.list_dir(target)) == {MANIFEST_NAME, *old, *new}
    delete_files(st, target, [*stale, "data-00009-gone.safetensors"])  # a missing one is fine
    assert st.list_dir(target) == sorted([MANIFEST_NAME, *new])


@pytest.mark.parametrize(
    "listed",
    [["../other/x", "a/b"], ["ok", MANIFEST_NAME, f"data-00000-{SID_NEW}.safetensors"]],
    ids=["outside", "inside"],
)
def test_overwrite_never_deletes_what_a_hostile_old_manifest_names(
    root: tuple[FsspecStorage, str], listed: list[str]
) -> None:
    st, base = root
    target = st.join(base, "ckpt")
    st.prepare_pending(target)
    doc = json.loads(_manifest(SID_OLD, []))
    doc["files"] = {
        f: {"size": 8, "header_bytes": 8, "header_checksum": "0" * 16, "index_checksum": None} for f in listed
    }
    st.fs.pipe_file(st._p(st.join(target, MANIFEST_NAME)), json.dumps(seal_manifest(doc)).encode())  # re-sealed
    new = {f"data-00000-{SID_NEW}.safetensors": b"new"}
    assert _save(st, target, SID_NEW, new, overwrite=True) == []  # nothing of it is ever deleted
    assert st.list_dir(target) == sorted([MANIFEST_NAME, *new])
    with pytest.raises(ValueError, match="plain file name"):
        st.join(target, "../x")
    with pytest.raises(ValueError, match="only the files it writes"):
        delete_files(st, target, ["ok", MANIFEST_NAME])


def test_discard_removes_only_the_failed_save(root: tuple[FsspecStorage, str]) -> None:
    st, base = root
    target = st.join(base, "ckpt")
    kept = {f"data-00000-{SID_OLD}.safetensors": b"committed"}
    _save(st, target, SID_OLD, kept)
    other = st.join(target, "data-00003-1699999999cccc.safetensors")  # another failed save's orphan
    _put(st, other, b"orphan")
    staging = st.pending_dir(target, SID_NEW)
    st.prepare_pending(staging)
    _put(st, st.join(staging, f"data-00000-{SID_NEW}.safetensors"), b"failed")
    unfinished = st.open_writer(st.join(staging, f"data-00001-{SID_NEW}.safetensors"))
    unfinished.write(memoryview(os.urandom(3 * PART)))  # on S3: a multipart upload in progress
    discard_save(st, staging, target, SID_NEW, 2)
    assert st.list_dir(target) == sorted([MANIFEST_NAME, *kept, other.rsplit("/", 1)[1]])
    if st.s3:
        assert list_uploads(st.fs, st._p(target) + "/", FAST) == []
    assert st.read_bytes(st.join(target, f"data-00000-{SID_OLD}.safetensors")) == b"committed"


def test_discard_after_the_commit_happened_keeps_everything(root: tuple[FsspecStorage, str]) -> None:
    st, base = root
    target = st.join(base, "ckpt")
    files = {f"data-00000-{SID_NEW}.safetensors": b"x"}
    _save(st, target, SID_NEW, files)
    # (never happens: staging is discarded only where "abort" was decided; but if it did)
    discard_save(st, target, target, SID_NEW, 1)
    assert st.list_dir(target) == sorted([MANIFEST_NAME, *files])


def test_abort_leaves_nothing(root: tuple[FsspecStorage, str]) -> None:
    st, base = root
    st.prepare_pending(base)
    url = st.join(base, "data-00000-x.safetensors")
    w = st.open_writer(url)
    w.write(memoryview(os.urandom(5 * PART // 2)))
    w.abort()
    assert not st.exists(url)
    assert st.list_dir(base) == []
    if st.s3:
        assert list_uploads(st.fs, st._p(base) + "/", FAST) == []


def test_missing_and_short_reads(root: tuple[FsspecStorage, str]) -> None:
    st, base = root
    st.prepare_pending(base)
    url = st.join(base, "f")
    _put(st, url, b"0123456789")
    with pytest.raises(EOFError, match="truncated"):
        st.read_into(url, 5, memoryview(bytearray(10)))  # runs past the end
    with pytest.raises(EOFError, match="truncated"):
        st.read_into(url, 20, memoryview(bytearray(4)))  # starts past the end
    missing = st.join(base, "nothing")
    with pytest.raises(FileNotFoundError):
        st.read_bytes(missing)
    with pytest.raises(FileNotFoundError):
        st.size(missing)
    assert not st.exists(missing)
    assert st.list_dir(missing) == []


def test_manager_operations_on_a_prefix(root: tuple[FsspecStorage, str]) -> None:
    st, base = root
    target = st.join(base, "step-7")
    before = time.time()
    _save(st, target, SID_OLD, {"data-00000-a.safetensors": b"12345", "data-00001-a.safetensors": b"678"})
    assert st.is_dir(target) and not st.is_dir(st.join(target, MANIFEST_NAME))
    assert st.size(st.join(target, "data-00000-a.safetensors")) == 5
    assert st.size(target) == 8 + len(st.read_bytes(st.join(target, MANIFEST_NAME)))
    assert st.mtime(target) >= before - 5  # store clocks round to seconds
    delete_files(st, target, ["data-00001-a.safetensors"])
    delete_files(st, target, ["data-00001-a.safetensors"])  # twice: missing is fine
    st.fs.pipe_file(st._p(st.join(target, "notes.txt")), b"someone else's")
    assert delete_checkpoint(st, target) == ["data-00000-a.safetensors", "data-00001-a.safetensors"]
    assert st.list_dir(target) == ["notes.txt"]  # uncommitted, tombstone gone, the foreign file kept
    assert TOMBSTONE not in st.list_dir(target)


def test_get_storage_routes_urls_here(s3_server: S3Server, s3_bucket: str) -> None:
    st = get_storage(f"s3://{s3_bucket}/x", s3_server.storage_options)
    assert isinstance(st, FsspecStorage) and st.s3
    with pytest.raises(ValueError, match="chained"):
        FsspecStorage.for_path("simplecache::s3://b/x")


# -- S3 multipart ------------------------------------------------------------------------------


def test_large_file_uploads_parts_in_parallel(s3_server: S3Server, s3_bucket: str, monkeypatch: Any) -> None:
    monkeypatch.setenv("SHARDSAFE_REMOTE_PART_BYTES", str(PART))
    monkeypatch.setenv("SHARDSAFE_REMOTE_UPLOAD_THREADS", "3")
    st = _flaky(s3_server, part_delay=0.2)
    data = os.urandom(6 * PART + 1234)
    url = f"flakys3://{s3_bucket}/ckpt/data-00000-{SID_NEW}.safetensors"
    _put(st, url, data, piece=PART // 3 + 7)
    assert st.fs.calls["upload_part"] == 7 and st.fs.calls["complete_multipart_upload"] == 1
    assert st.fs.calls["put_object"] == 0
    assert 2 <= st.fs.max_active <= 3  # parts overlap, and no more than the pool's threads
    assert st.read_bytes(url) == data
    out = bytearray(4 * PART)
    st.read_into(url, PART // 2, memoryview(out))  # split into parallel ranged reads
    assert bytes(out) == data[PART // 2 : PART // 2 + 4 * PART]
    assert st.fs.calls["get_object"] == 1 + 4


def test_small_file_is_one_put(s3_server: S3Server, s3_bucket: str, monkeypatch: Any) -> None:
    monkeypatch.setenv("SHARDSAFE_REMOTE_PART_BYTES", str(PART))
    st = _flaky(s3_server)
    url = f"flakys3://{s3_bucket}/ckpt/small"
    _put(st, url, b"abc" * 1000)
    _put(st, url + "-empty", b"")
    assert st.fs.calls["put_object"] == 2 and st.fs.calls["create_multipart_upload"] == 0
    assert st.read_bytes(url) == b"abc" * 1000 and st.read_bytes(url + "-empty") == b""


# -- retries and faults ------------------------------------------------------------------------


def test_transient_faults_are_retried_through_a_whole_save(
    s3_server: S3Server, s3_bucket: str, monkeypatch: Any
) -> None:
    monkeypatch.setenv("SHARDSAFE_REMOTE_PART_BYTES", str(PART))
    plan = {
        "create_multipart_upload": ["lost"],  # a stray upload, aborted after the commit
        "upload_part": ["slowdown", "lost", "ok", "reset"],
        "complete_multipart_upload": ["lost", "gone"],  # completed, reply lost; the retry: NoSuchUpload
        "put_object": ["lost", "slowdown"],  # the small file and the manifest
        "head_object": ["reset"],
        "list_objects_v2": ["slowdown"],
        "get_object": ["reset", "slowdown"],
        "delete_objects": ["lost"],
    }
    st = _flaky(s3_server, plan)
    target = f"flakys3://{s3_bucket}/ckpt"
    big, small = os.urandom(4 * PART + 99), b"small"
    _save(st, target, SID_OLD, {f"data-00000-{SID_OLD}.safetensors": b"old"})
    stale = _save(
        st,
        target,
        SID_NEW,
        {f"data-00000-{SID_NEW}.safetensors": big, f"data-00001-{SID_NEW}.safetensors": small},
        overwrite=True,
    )
    delete_files(st, target, stale)
    assert st.read_bytes(f"{target}/data-00000-{SID_NEW}.safetensors") == big
    out = bytearray(10)
    st.read_into(f"{target}/data-00000-{SID_NEW}.safetensors", PART, memoryview(out))
    assert bytes(out) == big[PART : PART + 10]
    assert st.list_dir(target) == sorted([MANIFEST_NAME, *(f"data-0000{r}-{SID_NEW}.safetensors" for r in (0, 1))])
    assert st.fs.pending() == {}, "every planned fault was injected (and survived)"
    assert list_uploads(st.fs, f"{s3_bucket}/ckpt/", FAST) == []


def test_outage_fails_naming_path_and_leaves_nothing_visible(
    s3_server: S3Server, s3_bucket: str, monkeypatch: Any
) -> None:
    monkeypatch.setenv("SHARDSAFE_REMOTE_PART_BYTES", str(PART))
    fs = FlakyS3FileSystem(plan={"upload_part": ["down"]}, skip_instance_cache=True, **s3_server.storage_options)
    st = FsspecStorage(fs, policy=RetryPolicy(deadline=0.5, base_delay=0.01, max_delay=0.05))
    target = f"flakys3://{s3_bucket}/ckpt"
    url = f"{target}/data-00000-{SID_NEW}.safetensors"
    st.pending_dir(target, SID_NEW)
    w = st.open_writer(url)
    t0 = time.monotonic()
    with pytest.raises(RemoteIOError) as info:
        w.write(memoryview(os.urandom(3 * PART)))
        w.close()
    assert time.monotonic() - t0 < 30  # bounded by the deadline, not hanging
    msg = str(info.value)
    assert url in msg and "upload part" in msg and "SHARDSAFE_REMOTE_RETRY_SECONDS" in msg
    assert isinstance(info.value, OSError) and fs.calls["upload_part"] > 2
    w.abort()
    discard_save(st, target, target, SID_NEW, 1)
    assert not st.exists(url) and st.list_dir(target) == []
    assert list_uploads(fs, f"{s3_bucket}/ckpt/", FAST) == []


def test_permanent_errors_are_not_retried(s3_server: S3Server, s3_bucket: str) -> None:
    st = _flaky(s3_server, {"get_object": ["denied"]})
    url = f"flakys3://{s3_bucket}/f"
    _put(st, url, b"data")
    with pytest.raises(PermissionError):
        st.read_bytes(url)
    assert st.fs.calls["get_object"] == 1
    before = sum(st.fs.calls.values())
    with pytest.raises(FileNotFoundError):
        st.read_bytes(url + "-missing")
    assert sum(st.fs.calls.values()) <= before + 2  # one request (s3fs may stat first), no retries


def test_transient_classification() -> None:
    from botocore.exceptions import ClientError, EndpointConnectionError

    def client_error(code: str, status: int) -> ClientError:
        return ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")

    assert is_transient(ConnectionResetError())
    assert is_transient(TimeoutError())
    assert is_transient(EndpointConnectionError(endpoint_url="http://x"))
    assert is_transient(OSError(errno.EBUSY, "SlowDown"))
    assert is_transient(client_error("SlowDown", 503)) and is_transient(client_error("Whatever", 500))
    assert is_transient(client_error("TooManyRequests", 429))
    wrapped = OSError(errno.EIO, "wrapped")
    wrapped.__cause__ = client_error("InternalError", 500)
    assert is_transient(wrapped)
    assert not is_transient(client_error("AccessDenied", 403))
    assert not is_transient(FileNotFoundError("x")) and not is_transient(PermissionError("x"))
    assert not is_transient(ValueError("bad"))
    gone = FileNotFoundError("NoSuchUpload")
    gone.__cause__ = ConnectionResetError()
    assert not is_transient(gone)


def test_retry_gives_up_at_the_deadline() -> None:
    attempts = []

    def flaky() -> None:
        attempts.append(time.monotonic())
        raise ConnectionResetError("reset")

    t0 = time.monotonic()
    with pytest.raises(RemoteIOError, match=r"read s3://b/k: still failing after \d+ attempts"):
        call("read", "s3://b/k", flaky, RetryPolicy(deadline=0.3, base_delay=0.01, max_delay=0.1))
    assert len(attempts) > 2 and time.monotonic() - t0 < 10
    ok = iter([ConnectionResetError(), OSError(errno.EBUSY, "SlowDown")])

    def twice_then_fine() -> str:
        err = next(ok, None)
        if err:
            raise err
        return "done"

    assert call("read", "s3://b/k", twice_then_fine, FAST) == "done"
    with pytest.raises(ValueError, match="positive"):
        RetryPolicy(deadline=0)
