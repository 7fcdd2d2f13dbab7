"""S3 conditional writes are checked, not trusted, and the store's answers to them are read right
(through :mod:`fault_proxy`, which stands for the store's misbehaviour, in front of the moto server):

- a store that ignores ``If-None-Match`` / ``If-Match`` (the proxy strips them) is refused at the first
  save, naming its endpoint and bucket, and nothing is left in the prefix: there, a manifest PUT the
  network delivers late would come back over a newer checkpoint;
- a ``501 NotImplemented`` to a conditional header is not retried (it is no transient error) and the
  save says what is definite: nothing was committed;
- a ``409 ConditionalRequestConflict`` (concurrent conditional writes of the key) is retried;
- after a definite refusal of the manifest PUT (403), the message says nothing was committed, not
  that it "may still complete";
- the check costs two requests once per process and store (endpoint and bucket), none after.
"""

from __future__ import annotations

# ruff: noqa: F811  (the S3 fixtures are imported from conftest_s3 and named as test parameters)
from collections.abc import Iterator
from typing import Any

import pytest
import s3fs
import torch

import shardsafe
from shardsafe.storage import conditional

from conftest_s3 import s3_bucket, s3_server  # noqa: F401
from fault_proxy import FaultProxy
from s3_server import S3Server

MANIFEST = "/*/MANIFEST.json"
MARKER = "/*/.MANIFEST.json.tmp-*"
TIMEOUT = 20.0


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    conditional.forget()
    with FaultProxy(s3_server.port, lifetime=300) as p:
        yield p
    conditional.forget()


def _through(proxy: FaultProxy, server: S3Server) -> dict[str, Any]:
    opts = dict(server.storage_options)
    opts["client_kwargs"] = {**opts["client_kwargs"], "endpoint_url": proxy.endpoint_url}
    return opts


def _state(value: float) -> dict[str, Any]:
    return {"w": torch.full((32,), value), "step": int(value)}


def _keys(server: S3Server, bucket: str) -> list[str]:
    fs = s3fs.S3FileSystem(**server.storage_options)
    return sorted(p.split("/", 1)[1] for p in fs.find(bucket))


def _save(url: str, opts: dict[str, Any], value: float) -> None:
    shardsafe.save(url, _state(value), storage_options=opts, overwrite=True, timeout=TIMEOUT)


def _loads_as(url: str, server: S3Server, value: float) -> None:
    shardsafe.verify(url, storage_options=server.storage_options)
    assert shardsafe.load(url, storage_options=server.storage_options)["step"] == int(value)


@pytest.mark.timeout(120)
def test_a_store_that_ignores_conditional_headers_is_refused_naming_it(
    s3_server: S3Server, s3_bucket: str, proxy: FaultProxy
) -> None:
    opts = _through(proxy, s3_server)
    proxy.add("strip", "PUT", times=None, headers=("If-Match", "If-None-Match"))
    url = f"s3://{s3_bucket}/run/ckpt"
    with pytest.raises(shardsafe.StorageError) as info:
        _save(url, opts, 1.0)
    message = str(info.value)
    assert proxy.endpoint_url in message and s3_bucket in message and "conditional" in message, message
    assert _keys(s3_server, s3_bucket) == []  # its in-flight marker went too; no data file was written
    with pytest.raises(shardsafe.StorageError):  # remembered for the process: refused at once
        _save(url, opts, 2.0)
    assert len(proxy.requests("PUT", MARKER)) == 3  # the first save's marker and its two checks; none after


@pytest.mark.timeout(120)
def test_a_store_whose_conditional_writes_work_is_checked_once(
    s3_server: S3Server, s3_bucket: str, proxy: FaultProxy
) -> None:
    opts = _through(proxy, s3_server)
    url = f"s3://{s3_bucket}/ckpt"
    _save(url, opts, 1.0)
    assert len(proxy.requests("PUT", MARKER)) == 3  # the marker, then If-None-Match and If-Match checks
    _save(url, opts, 2.0)
    assert len(proxy.requests("PUT", MARKER)) == 4  # the second save's marker only
    _loads_as(url, s3_server, 2.0)
    assert not [k for k in _keys(s3_server, s3_bucket) if ".MANIFEST.json.tmp-" in k]  # markers went at commit


@pytest.mark.timeout(120)
def test_a_501_to_the_conditional_marker_is_refused_at_once(
    s3_server: S3Server, s3_bucket: str, proxy: FaultProxy
) -> None:
    opts = _through(proxy, s3_server)
    proxy.add("error", "PUT", MARKER, times=None, status=501, code="NotImplemented")
    url = f"s3://{s3_bucket}/ckpt"
    with pytest.raises(shardsafe.StorageError, match="501"):
        _save(url, opts, 1.0)
    assert len(proxy.requests("PUT", MARKER)) == 1  # not retried: a 501 is no transient error
    assert _keys(s3_server, s3_bucket) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("status, code", [(501, "NotImplemented"), (403, "AccessDenied")])
def test_a_definite_refusal_of_the_manifest_put_says_nothing_was_committed(
    s3_server: S3Server, s3_bucket: str, proxy: FaultProxy, status: int, code: str
) -> None:
    opts = _through(proxy, s3_server)
    url = f"s3://{s3_bucket}/ckpt"
    _save(url, opts, 1.0)
    proxy.add("error", "PUT", MANIFEST, times=None, status=status, code=code)
    with pytest.raises(shardsafe.CheckpointError) as info:
        _save(url, opts, 2.0)
    message = str(info.value)
    assert "may still complete" not in message and "nothing was committed" in message, message
    assert len(proxy.requests("PUT", MANIFEST)) == 2  # save 1's, and save 2's once: not retried
    proxy.clear()
    _loads_as(url, s3_server, 1.0)
    assert not [k for k in _keys(s3_server, s3_bucket) if ".MANIFEST.json.tmp-" in k]  # discarded whole
    assert len([k for k in _keys(s3_server, s3_bucket) if "/data-" in k]) == 1


@pytest.mark.timeout(120)
def test_a_409_conflict_of_the_manifest_put_is_retried(s3_server: S3Server, s3_bucket: str, proxy: FaultProxy) -> None:
    opts = _through(proxy, s3_server)
    url = f"s3://{s3_bucket}/ckpt"
    _save(url, opts, 1.0)
    proxy.add("error", "PUT", MANIFEST, times=1, status=409, code="ConditionalRequestConflict")
    _save(url, opts, 2.0)
    assert proxy.rules[0].acted == 1
    _loads_as(url, s3_server, 2.0)
