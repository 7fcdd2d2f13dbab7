"""The sweep of leftovers never costs a save in flight its files, and a save never commits a manifest
naming files that are gone.

Two saves of one path run here one inside the other (save B starts while save A builds its
manifest, at A's ``save.commit`` fault point), as two jobs or processes would:

- B's host clock is two hours ahead of A's and of the storage's (``time.time`` patched for B's call
  only): B's sweep reads ages on the storage's own clock, so A's files, fresh, stay, and A commits;
- A took longer than the leftover age: B's sweep may remove A's files, and A's publish then finds them
  gone (one listing) and fails without committing: B's checkpoint stays whole and loadable (before,
  A committed a manifest naming deleted files, over B's, and both saves were lost);
- a data file removed between the write and the publish makes the publish fail (local disks too,
  where the publish moved the files it found and skipped the rest);
- a manager's cleanup of another process's new checkpoint in flight (its in-flight marker fresh on the
  storage's clock) leaves it, however far ahead the cleaning host's clock is.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.engine import commit
from shardsafe.storage import get_storage

from conftest_s3 import s3_bucket, s3_server  # noqa: F401
from s3_server import S3Server

AHEAD = 2 * 3600.0


def _state(value: float) -> dict[str, Any]:
    return {"w": torch.full((16,), value), "step": int(value)}


@pytest.fixture(params=["local", "file", "s3"])
def where(request: Any, tmp_path: Path) -> Iterator[tuple[str, dict[str, Any] | None]]:
    """(URL of a checkpoint, storage options)."""
    if request.param == "local":
        yield str(tmp_path / "ck"), None
    elif request.param == "file":
        yield f"file://{tmp_path}/ck", None
    else:
        server: S3Server = request.getfixturevalue("s3_server")
        bucket = server.new_bucket()
        yield f"s3://{bucket}/ck", server.storage_options


def _during_commit(monkeypatch: pytest.MonkeyPatch, action: Callable[[], None]) -> None:
    """Run ``action()`` once, when the next save reaches its ``save.commit`` fault point (its data
    durable, its manifest not yet built)."""
    real = commit.fault_point
    armed = [True]

    def hook(point: str, rank: int | None = None) -> None:
        if point == "save.commit" and armed[0]:
            armed[0] = False
            action()
        real(point, rank)

    monkeypatch.setattr(commit, "fault_point", hook)


def _loads_as(url: str, opts: dict[str, Any] | None, value: float) -> None:
    shardsafe.verify(url, storage_options=opts)
    assert shardsafe.load(url, storage_options=opts)["step"] == int(value)


def _ahead(monkeypatch: pytest.MonkeyPatch, fn: Callable[[], None]) -> None:
    """``fn()`` on a host whose clock is ``AHEAD`` seconds ahead."""
    real = time.time
    with monkeypatch.context() as m:
        m.setattr(time, "time", lambda: real() + AHEAD)
        fn()


@pytest.mark.timeout(120)
def test_a_sweeper_whose_clock_is_ahead_leaves_a_save_in_flight(
    where: tuple[str, dict[str, Any] | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, opts = where
    shardsafe.save(url, _state(1.0), storage_options=opts)

    def other_job() -> None:
        _ahead(monkeypatch, lambda: shardsafe.save(url, _state(3.0), storage_options=opts, overwrite=True))

    _during_commit(monkeypatch, other_job)
    shardsafe.save(url, _state(2.0), storage_options=opts, overwrite=True)  # A commits after B, whole
    _loads_as(url, opts, 2.0)


@pytest.mark.timeout(120)
def test_a_save_longer_than_the_leftover_age_fails_and_the_other_stands(
    where: tuple[str, dict[str, Any] | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, opts = where
    monkeypatch.setenv("SHARDSAFE_LEFTOVER_AGE_SECONDS", "0.5")
    shardsafe.save(url, _state(1.0), storage_options=opts)

    def other_job() -> None:
        time.sleep(1.05)  # A's files, marker and save id are older than the leftover age, on every clock
        shardsafe.save(url, _state(3.0), storage_options=opts, overwrite=True)

    _during_commit(monkeypatch, other_job)
    with pytest.raises(shardsafe.CheckpointError, match=r"no longer in|nothing was committed"):
        shardsafe.save(url, _state(2.0), storage_options=opts, overwrite=True)
    monkeypatch.undo()
    _loads_as(url, opts, 3.0)


@pytest.mark.timeout(120)
def test_a_data_file_gone_before_the_publish_fails_the_save(
    where: tuple[str, dict[str, Any] | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, opts = where
    shardsafe.save(url, _state(1.0), storage_options=opts)
    storage = get_storage(url, opts)
    before = set(storage.list_dir(url))

    def remove_a_file() -> None:
        parent = url.rstrip("/").rsplit("/", 1)[0]
        for folder in [url, *[storage.join(parent, n) for n in storage.list_dir(parent) if ".staging-" in n]]:
            for n in storage.list_dir(folder):
                if n.startswith("data-") and (folder != url or n not in before):
                    storage.unlink_names(folder, [n])

    _during_commit(monkeypatch, remove_a_file)
    with pytest.raises(shardsafe.CheckpointError, match="no longer in"):
        shardsafe.save(url, _state(2.0), storage_options=opts, overwrite=True)
    monkeypatch.undo()
    _loads_as(url, opts, 1.0)


@pytest.mark.timeout(120)
def test_a_manager_cleanup_leaves_a_new_checkpoint_in_flight_of_another_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On URL storage a first save's data files go straight into a folder without a manifest, marked
    by its in-flight marker: another process's manager cleanup, its clock two hours ahead, leaves it."""
    root = f"file://{tmp_path}/run"
    other = f"{root}/step-00000009"

    def cleanup_elsewhere() -> None:
        def manager_save() -> None:
            with shardsafe.CheckpointManager(root, leftover_age=3600) as mgr:
                mgr.save(1, _state(1.0))

        _ahead(monkeypatch, manager_save)

    _during_commit(monkeypatch, cleanup_elsewhere)
    shardsafe.save(other, _state(9.0))
    monkeypatch.undo()
    _loads_as(other, None, 9.0)
    assert not [n for n in os.listdir(tmp_path / "run" / "step-00000009") if n.startswith(".")]
