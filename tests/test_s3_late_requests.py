"""A manifest PUT that the network delivers late, or twice, on a real S3 endpoint (moto over HTTP,
s3fs as the client). The client-side hook stands where the network would: it holds the request
(the client sees a timeout and retries), or sends it and loses the reply, and later the held request
reaches the server unchanged, headers included. Whatever arrives when, every committed checkpoint
verifies and the newest committed save is the one that loads."""

from __future__ import annotations

# ruff: noqa: F811  (the S3 fixtures are imported from conftest_s3 and named as test parameters)
from collections.abc import Callable
from typing import Any

import pytest
import s3fs
import torch
from fsspec.asyn import sync

import shardsafe
from shardsafe.storage.uploads import precondition_failed

from conftest_s3 import s3_bucket, s3_server  # noqa: F401
from s3_server import S3Server

_REAL_CALL = s3fs.S3FileSystem._call_s3


def _is_manifest_put(method: str, kwargs: dict[str, Any]) -> bool:
    return method == "put_object" and str(kwargs.get("Key", "")).endswith("/MANIFEST.json")


def _intercept(monkeypatch: pytest.MonkeyPatch, on_manifest: Callable[..., Any]) -> None:
    """Route the next manifest PUT through ``on_manifest(fs, kwargs)``; every other request as it is."""
    armed = [True]

    async def call(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        if armed[0] and _is_manifest_put(method, kwargs):
            armed[0] = False
            return await on_manifest(self, kwargs)
        return await _REAL_CALL(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", call)


def _deliver(fs: Any, kwargs: dict[str, Any]) -> Any:
    """The held request reaches the server now, exactly as it was sent."""
    return sync(fs.loop, _REAL_CALL, fs, "put_object", **kwargs)


def _state(value: float) -> dict[str, Any]:
    return {"w": torch.full((256,), value), "step": int(value)}


def _loads_as(url: str, opts: dict[str, Any], value: float) -> None:
    shardsafe.verify(url, storage_options=opts)
    got = shardsafe.load(url, storage_options=opts)
    assert torch.equal(got["w"], torch.full((256,), value)) and got["step"] == int(value)


@pytest.mark.parametrize("first", ["overwrite", "new"])
def test_a_manifest_put_held_past_the_timeout_and_delivered_after_a_later_overwrite_is_refused(
    s3_server: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch, first: str
) -> None:
    opts = s3_server.storage_options
    url = f"s3://{s3_bucket}/ckpt"
    if first == "overwrite":
        shardsafe.save(url, _state(1.0), storage_options=opts)
    held: list[tuple[Any, dict[str, Any]]] = []

    async def hold(fs: Any, kwargs: dict[str, Any]) -> Any:
        held.append((fs, dict(kwargs)))
        raise TimeoutError("the request is held in the network; the client's read timed out")

    _intercept(monkeypatch, hold)
    shardsafe.save(url, _state(2.0), storage_options=opts, overwrite=True)  # the retry commits it
    assert len(held) == 1
    _loads_as(url, opts, 2.0)
    shardsafe.save(url, _state(3.0), storage_options=opts, overwrite=True)  # save 2's objects go as stale
    _loads_as(url, opts, 3.0)
    fs, kwargs = held[0]
    with pytest.raises(OSError) as refused:
        _deliver(fs, kwargs)
    assert precondition_failed(refused.value), refused.value  # 412: the store refused the stale PUT
    _loads_as(url, opts, 3.0)  # not a manifest pointing at save 2's deleted objects


def test_a_manifest_put_whose_reply_is_lost_commits_once(
    s3_server: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The PUT lands, its reply is lost, the retry is refused (the manifest is no longer the one it
    was conditioned on): the save reads back its own manifest and returns, committed."""
    opts = s3_server.storage_options
    url = f"s3://{s3_bucket}/ckpt"
    shardsafe.save(url, _state(1.0), storage_options=opts)
    landed: list[int] = []

    async def land_then_lose_the_reply(fs: Any, kwargs: dict[str, Any]) -> Any:
        await _REAL_CALL(fs, "put_object", **kwargs)
        landed.append(1)
        raise TimeoutError("the reply was lost")

    _intercept(monkeypatch, land_then_lose_the_reply)
    shardsafe.save(url, _state(2.0), storage_options=opts, overwrite=True)
    assert landed == [1]
    _loads_as(url, opts, 2.0)


def test_a_save_whose_manifest_was_replaced_meanwhile_does_not_commit_over_it(
    s3_server: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another writer replaces the manifest between this save's read of it and this save's PUT (here:
    the same checkpoint written again with one more byte, a new ETag): this save's conditional PUT is
    refused, the save fails on every rank, and what the other writer put there stands."""
    opts = s3_server.storage_options
    url = f"s3://{s3_bucket}/ckpt"
    shardsafe.save(url, _state(1.0), storage_options=opts)
    key = "ckpt/MANIFEST.json"

    async def another_writer_first(fs: Any, kwargs: dict[str, Any]) -> Any:
        got = await _REAL_CALL(fs, "get_object", Bucket=s3_bucket, Key=key)
        body = await got["Body"].read()
        await _REAL_CALL(fs, "put_object", Bucket=s3_bucket, Key=key, Body=bytes(body) + b"\n")
        return await _REAL_CALL(fs, "put_object", **kwargs)

    _intercept(monkeypatch, another_writer_first)
    with pytest.raises(shardsafe.CheckpointError, match="replaced by another save"):
        shardsafe.save(url, _state(2.0), storage_options=opts, overwrite=True)
    _loads_as(url, opts, 1.0)
