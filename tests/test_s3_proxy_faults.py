"""Saves and loads on S3 through a hostile network: :mod:`fault_proxy` sits between s3fs and the moto
server and holds, duplicates, reorders, drops the reply to, answers 500 to or black-holes chosen
requests. Whatever it does, every call returns or raises a CheckpointError within its ``timeout`` + 15
s, every committed checkpoint under the root verifies, and the newest committed save is the one
that loads, bit for bit. The store's truth is read around the proxy, on the server itself."""

from __future__ import annotations

# ruff: noqa: F811  (the S3 fixtures are imported from conftest_s3 and named as test parameters)
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.deadline import Deadline
from shardsafe.storage import MANIFEST_NAME
from shardsafe.storage.remote import FsspecStorage

from conftest_s3 import PART, s3_bucket, s3_server  # noqa: F401
from fault_proxy import FaultProxy
from harness import run_ranks
from s3_server import S3Server

SLACK = 15.0
"""A call ends within its timeout plus this (a deadline bound, not a timing benchmark)."""
TIMEOUT = 6.0
"""The timeout of a call that succeeds (the S3 client's read timeout is a quarter of it)."""
SHORT = 3.0
"""The timeout of a call that fails at its deadline (what it waits for never comes)."""
N = 3 * PART // 4 + 1000
"""float32 elements of the big tensor: a data file of 4 multipart parts."""
MANIFEST = "/*/MANIFEST.json"
DATA = "/*/data-*"


@pytest.fixture
def proxy(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    monkeypatch.setenv("SHARDSAFE_REMOTE_PART_BYTES", str(PART))
    monkeypatch.setenv("SHARDSAFE_REMOTE_UPLOAD_THREADS", "2")
    with FaultProxy(s3_server.port, lifetime=300) as p:
        yield p


def _through(proxy: FaultProxy, server: S3Server) -> dict[str, Any]:
    opts = dict(server.storage_options)
    opts["client_kwargs"] = {**opts["client_kwargs"], "endpoint_url": proxy.endpoint_url}
    return opts


def _state(value: float) -> dict[str, Any]:
    return {"big": torch.full((N,), value), "small": torch.arange(64.0) + value, "step": int(value)}


def _timed(timeout: float, fn: Callable[[], Any]) -> BaseException | None:
    """Run ``fn``; its CheckpointError (``None``: it returned). Either within ``timeout`` + SLACK."""
    start = time.monotonic()
    try:
        fn()
        error: BaseException | None = None
    except shardsafe.CheckpointError as err:
        error = err
    took = time.monotonic() - start
    assert took < timeout + SLACK, f"the call took {took:.1f}s with timeout={timeout} ({error!r})"
    return error


def _save(url: str, opts: dict[str, Any], value: float, timeout: float = TIMEOUT) -> BaseException | None:
    """Save ``_state(value)``; its manifest carries ``_tag(value)`` (a proxy rule can pick its requests)."""
    return _timed(
        timeout,
        lambda: shardsafe.save(
            url, _state(value), storage_options=opts, overwrite=True, timeout=timeout, metadata=_tag(value)
        ),
    )


def _tag(value: float) -> str:
    return f"the save of {value}"


def _committed(root: str, opts: dict[str, Any]) -> list[str]:
    """URLs of the checkpoints under ``root`` (those with a manifest), every one verified."""
    st = FsspecStorage.for_path(root, opts)
    found = [f"{root}/{n}" for n in st.list_dir(root) if st.exists(f"{root}/{n}/{MANIFEST_NAME}")]
    for url in found:
        shardsafe.verify(url, storage_options=opts)
    return found


def _loads_as(url: str, opts: dict[str, Any], value: float, timeout: float = 30.0) -> None:
    """``url`` loads as the save of ``value``, bit for bit."""
    got = shardsafe.load(url, storage_options=opts, timeout=timeout)
    want = _state(value)
    assert got["step"] == want["step"], (got["step"], value)
    for key in ("big", "small"):
        assert got[key].view(torch.int32).equal(want[key].view(torch.int32)), key


def _check(root: str, opts: dict[str, Any], newest: str, value: float) -> None:
    """Every checkpoint under ``root`` verifies, and ``newest`` loads as the save of ``value``."""
    assert newest in _committed(root, opts)
    _loads_as(newest, opts, value)


# ----------------------------------------------------------------------------------------- (a)


@pytest.mark.timeout(120)
def test_a_manifest_put_held_past_the_timeout_is_refused_after_a_later_overwrite(
    s3_server: S3Server, s3_bucket: str, proxy: FaultProxy
) -> None:
    """Every copy of save 2's manifest PUT is held until save 2 gave up; save 3 commits; then the
    held copies reach the server, which refuses them (412): save 3 stays, whole."""
    direct, opts = s3_server.storage_options, _through(proxy, s3_server)
    root = f"s3://{s3_bucket}/run"
    url = f"{root}/ckpt"
    assert _save(url, opts, 1.0) is None
    # every copy of save 2's manifest PUT, the client's retries that come after save 2 gave up included
    proxy.add("hold", "PUT", MANIFEST, times=None, body=_tag(2.0).encode())
    failed = _save(url, opts, 2.0, SHORT)
    assert isinstance(failed, shardsafe.CheckpointError), failed  # never answered: it did not commit
    assert proxy.held
    _check(root, direct, url, 1.0)
    assert _save(url, opts, 3.0) is None
    for request in proxy.held:
        assert proxy.release(request).status == 412  # conditional on save 1's manifest, which is gone
    _check(root, direct, url, 3.0)


@pytest.mark.timeout(120)
def test_a_manifest_put_held_past_the_timeout_and_delivered_before_the_next_save_commits_whole(
    s3_server: S3Server, s3_bucket: str, proxy: FaultProxy
) -> None:
    """A save that gave up while its manifest PUT was in the network kept its data objects: when the
    PUT lands later, the checkpoint it commits is whole; the next save replaces it as usual."""
    direct, opts = s3_server.storage_options, _through(proxy, s3_server)
    root = f"s3://{s3_bucket}/run"
    url = f"{root}/ckpt"
    assert _save(url, opts, 1.0) is None
    proxy.add("hold", "PUT", MANIFEST, times=None)
    assert _save(url, opts, 2.0, SHORT) is not None
    proxy.clear()
    first, *rest = proxy.held
    assert proxy.release(first).status == 200  # lands: save 2 is committed after all
    _check(root, direct, url, 2.0)
    for request in rest:
        assert proxy.release(request).status == 412
    assert _save(url, opts, 3.0) is None
    _check(root, direct, url, 3.0)


@pytest.mark.timeout(120)
def test_a_manifest_put_held_once_is_retried_by_the_client_and_commits_once(
    s3_server: S3Server, s3_bucket: str, proxy: FaultProxy
) -> None:
    """One copy held: the client's read timeout (a fraction of ``timeout``) sends it again, within the
    deadline; the save commits; the held copy, delivered after a later save, is refused."""
    direct, opts = s3_server.storage_options, _through(proxy, s3_server)
    root = f"s3://{s3_bucket}/run"
    url = f"{root}/ckpt"
    assert _save(url, opts, 1.0) is None
    proxy.add("hold", "PUT", MANIFEST, times=1)
    assert _save(url, opts, 2.0) is None
    assert len(proxy.held) == 1 and len(proxy.requests("PUT", MANIFEST)) >= 3
    _check(root, direct, url, 2.0)
    assert _save(url, opts, 3.0) is None
    assert proxy.release(proxy.held[0]).status == 412
    _check(root, direct, url, 3.0)


# ----------------------------------------------------------------------------------------- (b)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("reply", ["first", "second"])
def test_b_duplicated_requests(s3_server: S3Server, s3_bucket: str, proxy: FaultProxy, reply: str) -> None:
    """Every data request (part uploads, the multipart start and completion, whole-object PUTs) and the
    manifest PUT reach the server twice; the client gets the first or the second reply (the repeated
    multipart start made a second upload; the repeated conditional PUT answers 412)."""
    direct, opts = s3_server.storage_options, _through(proxy, s3_server)
    root = f"s3://{s3_bucket}/run"
    url = f"{root}/ckpt"
    for method, path in (("PUT", DATA), ("POST", DATA), ("PUT", MANIFEST)):
        proxy.add("duplicate", method, path, times=None, reply=reply)
    assert _save(url, opts, 1.0) is None
    assert _save(url, opts, 2.0) is None
    _check(root, direct, url, 2.0)
    assert len(proxy.requests("POST", DATA)) >= 4  # starts and completions, each sent twice
    assert _no_uploads_left(direct, s3_bucket)


# ----------------------------------------------------------------------------------------- (c)


@pytest.mark.timeout(120)
def test_c_reordered_requests(s3_server: S3Server, s3_bucket: str, proxy: FaultProxy) -> None:
    """Part 1 reaches the server after part 3; save 2's manifest PUT after its own retry (the client
    gave up on it first); a load's first ranged GET after a later one."""
    direct, opts = s3_server.storage_options, _through(proxy, s3_server)
    root = f"s3://{s3_bucket}/run"
    url = f"{root}/ckpt"
    proxy.add("after", "PUT", DATA, query="partNumber=1&", trigger=_rule("PUT", DATA, "partNumber=3&"))
    assert _save(url, opts, 1.0) is None
    proxy.add("after", "PUT", MANIFEST, trigger=_rule("PUT", MANIFEST), max_hold=30)
    assert _save(url, opts, 2.0) is None
    _check(root, direct, url, 2.0)
    proxy.add("after", "GET", DATA, trigger=_rule("GET", DATA), max_hold=30)
    assert _timed(TIMEOUT, lambda: _loads_as(url, opts, 2.0, TIMEOUT)) is None
    _check(root, direct, url, 2.0)


def _rule(method: str, path: str, query: str | None = None) -> Any:
    from fault_proxy import Rule

    return Rule("pass", method, path, query=query)


# ----------------------------------------------------------------------------------------- (d)


@pytest.mark.timeout(120)
def test_d_lost_replies(s3_server: S3Server, s3_bucket: str, proxy: FaultProxy) -> None:
    """The server carries out the request, the reply never comes back (the connection closes): the
    multipart start (a second upload appears), a part, the completion, the manifest PUT, a delete."""
    direct, opts = s3_server.storage_options, _through(proxy, s3_server)
    root = f"s3://{s3_bucket}/run"
    url = f"{root}/ckpt"
    for method, path, query in (
        ("POST", DATA, "uploads"),
        ("PUT", DATA, "partNumber=2&"),
        ("POST", DATA, "uploadId="),
        ("PUT", MANIFEST, None),
    ):
        proxy.add("lose", method, path, query=query)
    assert _save(url, opts, 1.0) is None
    _check(root, direct, url, 1.0)
    assert _no_uploads_left(direct, s3_bucket)  # the stray upload of the lost start is aborted
    for method, path, query in (("POST", DATA, "uploadId="), ("PUT", MANIFEST, None), ("POST", "/*", "delete")):
        proxy.add("lose", method, path, query=query)
    assert _save(url, opts, 2.0) is None
    _check(root, direct, url, 2.0)
    assert _no_uploads_left(direct, s3_bucket)
    # The completion is carried out and the client is answered 404 NoSuchUpload: what S3 may answer
    # the copy of a repeated completion whose reply the client sees (moto answers 200).
    proxy.add("forward_error", "POST", DATA, query="uploadId=", status=404, code="NoSuchUpload")
    assert _save(url, opts, 3.0) is None
    _check(root, direct, url, 3.0)


# ----------------------------------------------------------------------------------------- (e)


@pytest.mark.timeout(120)
def test_e_a_short_500_storm_is_retried(s3_server: S3Server, s3_bucket: str, proxy: FaultProxy) -> None:
    direct, opts = s3_server.storage_options, _through(proxy, s3_server)
    root = f"s3://{s3_bucket}/run"
    url = f"{root}/ckpt"
    assert _save(url, opts, 1.0) is None
    proxy.add("error", times=4)  # whatever comes next
    assert _save(url, opts, 2.0) is None
    assert proxy.rules[0].acted == 4
    _check(root, direct, url, 2.0)


@pytest.mark.timeout(120)
def test_e_a_long_500_storm_fails_cleanly_within_the_timeout(
    s3_server: S3Server, s3_bucket: str, proxy: FaultProxy
) -> None:
    direct, opts = s3_server.storage_options, _through(proxy, s3_server)
    root = f"s3://{s3_bucket}/run"
    url = f"{root}/ckpt"
    assert _save(url, opts, 1.0) is None
    proxy.add("error", "PUT", DATA, query="partNumber=2&", times=1)  # the storm starts mid-upload
    proxy.add("error", times=None, skip=1)
    assert isinstance(_save(url, opts, 2.0, SHORT), shardsafe.CheckpointError)
    loaded = _timed(SHORT, lambda: shardsafe.load(url, storage_options=opts, timeout=SHORT))
    assert isinstance(loaded, shardsafe.CheckpointError)
    proxy.clear()
    _check(root, direct, url, 1.0)


# ----------------------------------------------------------------------------------------- (f)


def _save_ranks(rank: int, world: int, url: str, opts: dict[str, Any], value: float, timeout: float) -> Any:
    state = {
        "a": torch.full((N,), value),  # one data file per rank, each of several parts
        "b": torch.full((N,), -value),
        "step": int(value),
    }
    start = time.monotonic()
    try:
        shardsafe.save(url, state, storage_options=opts, overwrite=True, timeout=timeout)
        error = None
    except shardsafe.CheckpointError as err:
        error = f"{type(err).__name__}: {err}"
    return {"error": error, "took": time.monotonic() - start}


@pytest.mark.timeout(150)
def test_f_an_endpoint_black_holed_mid_save_on_two_ranks(
    s3_server: S3Server, s3_bucket: str, proxy: FaultProxy
) -> None:
    """After a few part uploads every request to the store (both ranks') goes unanswered: each rank
    fails within ``timeout`` + 15 s; the previous checkpoint stays, whole."""
    direct, opts = s3_server.storage_options, _through(proxy, s3_server)
    root = f"s3://{s3_bucket}/run"
    url = f"{root}/ckpt"
    env = {"SHARDSAFE_REMOTE_PART_BYTES": str(PART), "SHARDSAFE_REMOTE_UPLOAD_THREADS": "2"}
    assert _save(url, opts, 1.0) is None  # the previous checkpoint, from one process
    proxy.add("blackhole", "PUT", DATA, skip=3, times=None, spread=True)
    out = run_ranks(_save_ranks, 2, url, opts, 2.0, SHORT, env=env, timeout=SHORT + SLACK + 30)
    for o in out:
        assert o.ok and not o.killed, o
        assert o.result["error"] is not None, o.result
        assert o.result["took"] < SHORT + SLACK, o.result
    assert proxy.rules[0].acted > 1
    _check(root, direct, url, 1.0)


# ------------------------------------------------------------------------ the botocore budget


@pytest.mark.timeout(60)
def test_the_client_of_a_save_times_out_and_retries_within_the_timeout(s3_server: S3Server, s3_bucket: str) -> None:
    """The S3 client a save makes has botocore connect and read timeouts of at most its ``timeout``
    and a bounded number of attempts (its own, and s3fs' loop around them); values the user set
    stay."""
    opts = s3_server.storage_options
    url = f"s3://{s3_bucket}/run/ckpt"
    st = FsspecStorage.for_path(url, opts, deadline=Deadline.after(4.0, "end"))
    config = st.fs.config_kwargs
    assert config["read_timeout"] <= 4.0 and config["connect_timeout"] <= 4.0
    assert config["retries"]["total_max_attempts"] <= 2
    assert st.fs.retries <= 2
    st.exists(url)  # the client is made on the first request
    assert st.fs.s3.meta.config.read_timeout <= 4.0
    mine = {**opts, "config_kwargs": {"read_timeout": 99, "retries": {"max_attempts": 7}}}
    kept = FsspecStorage.for_path(url, mine, deadline=Deadline.after(4.0, "end")).fs.config_kwargs
    assert kept["read_timeout"] == 99 and kept["retries"] == {"max_attempts": 7} and kept["connect_timeout"] <= 4.0


@pytest.mark.timeout(60)
def test_a_request_to_a_black_hole_is_cut_by_the_client_itself(s3_server: S3Server, proxy: FaultProxy) -> None:
    """A request made on the storage's filesystem directly (no thread of shardsafe's waiting for it)
    ends on its own, by botocore's read timeout, within the operation's timeout: a request abandoned
    at a deadline does not hold a thread and a connection for minutes."""
    opts = _through(proxy, s3_server)
    proxy.add("blackhole", times=None)
    timeout = SHORT
    st = FsspecStorage.for_path("s3://bucket/x", opts, deadline=Deadline.after(timeout, "end"))
    ended = threading.Event()
    errors: list[BaseException] = []

    def request() -> None:
        try:
            st.fs.call_s3("head_object", Bucket="bucket", Key="x")  # one request, on s3fs' own loop
        except BaseException as err:
            errors.append(err)
        finally:
            ended.set()

    threading.Thread(target=request, daemon=True).start()
    assert ended.wait(timeout + SLACK), "the request was still waiting for a reply"
    assert errors and "timeout" in f"{type(errors[0]).__name__} {errors[0]!r}".lower(), errors


def _no_uploads_left(opts: dict[str, Any], bucket: str) -> bool:
    from shardsafe.storage.retry import RetryPolicy
    from shardsafe.storage.uploads import list_uploads

    st = FsspecStorage.for_path(f"s3://{bucket}", opts)
    return list_uploads(st.fs, f"{bucket}/", RetryPolicy()) == []
