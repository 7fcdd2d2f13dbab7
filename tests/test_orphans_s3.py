"""The orphan rule of ``tests/test_orphans.py`` on an object store (moto over HTTP): a save's data objects
go straight into the checkpoint's prefix, so an object another writer's save left there without
committing is told from a save in flight only by its save id (its start time, a temporary manifest)
and its age. The store cannot backdate an object, so the leftover age is set to a few seconds and the
tests wait them out; ages are read on the store's own clock."""

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


AGE = 4.0
"""The leftover age of these tests: the store's clock counts whole seconds (``LastModified``), so a
save in flight must sweep within ``AGE - 1`` s of its marker for it to count as fresh."""


def _copy_of_own(fs: s3fs.S3FileSystem, prefix: str, sid: str) -> str:
    own = next(p for p in fs.ls(prefix) if p.rsplit("/", 1)[1].startswith("data-"))
    copy = f"{prefix}/{data_file(0, sid)}"
    fs.copy(own, copy)
    return copy.rsplit("/", 1)[1]


@pytest.mark.timeout(120)
def test_old_orphans_and_abandoned_saves_go_and_a_save_in_flight_stays(
    s3_server: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save in flight is told by its in-flight marker (its temporary manifest, empty), which changed
    within the leftover age on the store's clock: its objects stay, however old its save id says it is.
    An old orphan without a marker goes, and so does a save whose rank 0 died (its marker and objects
    unchanged for the leftover age); a committed save leaves no marker, and the sweep no clock probe."""
    monkeypatch.setenv("SHARDSAFE_LEFTOVER_AGE_SECONDS", str(AGE))
    opts = s3_server.storage_options
    url = f"s3://{s3_bucket}/ckpt"
    shardsafe.save(url, _state(1.0), storage_options=opts)
    fs = s3fs.S3FileSystem(**opts)
    prefix = f"{s3_bucket}/ckpt"
    old = int(time.time()) - 7200
    orphan = _copy_of_own(fs, prefix, f"{old}aaaaaaaaaa")
    dead_sid = f"{int(time.time())}cccccccccc"
    fs.pipe(f"{prefix}/{temp_manifest(dead_sid)}", b"")
    dead = _copy_of_own(fs, prefix, dead_sid)
    time.sleep(AGE + 1.1)
    in_flight_sid = f"{old}bbbbbbbbbb"
    fs.pipe(f"{prefix}/{temp_manifest(in_flight_sid)}", b"")  # that save has not committed yet
    in_flight = _copy_of_own(fs, prefix, in_flight_sid)
    shardsafe.save(url, _state(2.0), storage_options=opts, overwrite=True)
    fs.invalidate_cache()
    names = {p.rsplit("/", 1)[1] for p in fs.ls(prefix)}
    files = shardsafe.inspect(url, storage_options=opts).files
    assert names == {"MANIFEST.json", *files, in_flight, temp_manifest(in_flight_sid)}, (names, orphan, dead)
    shardsafe.verify(url, storage_options=opts)
    assert torch.equal(shardsafe.load(url, storage_options=opts)["w"], torch.full((64,), 2.0))
