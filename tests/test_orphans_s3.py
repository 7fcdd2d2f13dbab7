"""The orphan rule of ``tests/test_orphans.py`` on an object store (moto over HTTP): a save's data objects
go straight into the checkpoint's prefix, so an object another writer's save left there without
committing is told from a save in flight only by its save id (its start time, a temporary manifest)
and its age. The store cannot backdate an object, so the leftover age is set near 0 and the orphan's
save id is an old one."""

from __future__ import annotations

# ruff: noqa: F811  (the S3 fixtures are imported from conftest_s3 and named as test parameters)
import time
from typing import Any

import pytest
import s3fs
import torch

import shardsafe
from shardsafe.catalog.names import data_file, temp_manifest

from conftest_s3 import s3_bucket, s3_server  # noqa: F401
from s3_server import S3Server


def _state(value: float) -> dict[str, Any]:
    return {"w": torch.full((64,), value)}


@pytest.mark.timeout(120)
def test_an_old_orphan_object_goes_and_one_of_a_save_in_flight_stays(
    s3_server: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHARDSAFE_LEFTOVER_AGE_SECONDS", "0.01")
    opts = s3_server.storage_options
    url = f"s3://{s3_bucket}/ckpt"
    shardsafe.save(url, _state(1.0), storage_options=opts)
    fs = s3fs.S3FileSystem(**opts)
    prefix = f"{s3_bucket}/ckpt"
    own = next(p for p in fs.ls(prefix) if p.rsplit("/", 1)[1].startswith("data-"))
    old = int(time.time()) - 7200
    orphan = f"{prefix}/{data_file(0, f'{old}aaaaaaaaaa')}"
    in_flight_sid = f"{old}bbbbbbbbbb"
    in_flight = f"{prefix}/{data_file(0, in_flight_sid)}"
    fs.copy(own, orphan)
    fs.copy(own, in_flight)
    fs.pipe(f"{prefix}/{temp_manifest(in_flight_sid)}", b"{}")  # that save has not committed yet
    time.sleep(1.1)
    shardsafe.save(url, _state(2.0), storage_options=opts, overwrite=True)
    fs.invalidate_cache()
    names = {p.rsplit("/", 1)[1] for p in fs.ls(prefix)}
    assert orphan.rsplit("/", 1)[1] not in names
    assert in_flight.rsplit("/", 1)[1] in names
    shardsafe.verify(url, storage_options=opts)
    assert torch.equal(shardsafe.load(url, storage_options=opts)["w"], torch.full((64,), 2.0))
