"""``shardsafe.delete``: a checkpoint removed the catalog's way, refusals that touch nothing, symbolic
links removed as links, interrupted and concurrent deletions, a hung storage, ``storage_options`` on
local paths, and the same on an object store (moto)."""

from __future__ import annotations

# ruff: noqa: F811  (the S3 fixtures are imported from conftest_s3 and named as test parameters)
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.catalog.names import TOMBSTONE

from conftest_s3 import s3_bucket, s3_server  # noqa: F401
from s3_server import S3Server


def _save(path: Path | str, value: float = 1.0, **kw: Any) -> None:
    shardsafe.save(path, {"w": torch.full((8,), value), "step": int(value)}, **kw)


def _tree(root: Path) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for n in [*dirnames, *filenames]:
            p = Path(dirpath, n)
            out.append(f"{p.relative_to(root)}{'@' if p.is_symlink() else ''}")
    return sorted(out)


def test_a_committed_checkpoint_goes_whole_and_its_siblings_stay(tmp_path: Path) -> None:
    _save(tmp_path / "a", 1.0)
    _save(tmp_path / "b", 2.0)
    shardsafe.delete(tmp_path / "a", storage_options={"anon": True})  # ignored for a local path
    assert _tree(tmp_path) == sorted(["b", *(f"b/{n}" for n in os.listdir(tmp_path / "b"))])
    shardsafe.verify(tmp_path / "b")
    with pytest.raises(shardsafe.CheckpointNotFoundError, match=r"refusing to delete .*nothing is there"):
        shardsafe.delete(tmp_path / "a")


@pytest.mark.parametrize("kind", ["missing", "empty", "file", "foreign", "uncommitted", "dcp"])
def test_what_is_not_a_checkpoint_is_refused_untouched(tmp_path: Path, kind: str) -> None:
    target = tmp_path / "x"
    if kind == "empty":
        target.mkdir()
    elif kind == "file":
        target.write_bytes(b"torch.save bytes")
    elif kind == "foreign":
        target.mkdir()
        (target / "notes.txt").write_text("mine")
    elif kind == "uncommitted":
        _save(target)
        os.remove(target / "MANIFEST.json")
    elif kind == "dcp":
        target.mkdir()
        (target / ".metadata").write_bytes(b"pickle")
    before = _tree(tmp_path)
    words = {
        "missing": "nothing is there",
        "empty": "empty folder",
        "file": "is a file",
        "foreign": "no file shardsafe writes",
        "uncommitted": "uncommitted",
        "dcp": "DCP",
    }[kind]
    with pytest.raises(shardsafe.CheckpointNotFoundError, match=f"refusing to delete {target}.*{words}"):
        shardsafe.delete(target)
    assert _tree(tmp_path) == before


def test_a_manifest_that_does_not_validate_is_refused_untouched(tmp_path: Path) -> None:
    _save(tmp_path / "c")
    (tmp_path / "c" / "MANIFEST.json").write_text('{"format_version": 1, "files": {"../escape": {}}}')
    before = _tree(tmp_path)
    with pytest.raises(shardsafe.CorruptCheckpointError):
        shardsafe.delete(tmp_path / "c")
    assert _tree(tmp_path) == before


def test_files_shardsafe_did_not_write_stay_with_their_folder(tmp_path: Path) -> None:
    _save(tmp_path / "c")
    (tmp_path / "c" / "notes.txt").write_text("mine")
    shardsafe.delete(tmp_path / "c")
    assert _tree(tmp_path) == ["c", "c/notes.txt"]


def test_a_link_is_removed_as_a_link_never_followed(tmp_path: Path) -> None:
    _save(tmp_path / "epoch=1.ckpt", 3.0)
    (tmp_path / "last.ckpt").symlink_to("epoch=1.ckpt")
    shardsafe.delete(tmp_path / "last.ckpt")
    assert not os.path.lexists(tmp_path / "last.ckpt")
    shardsafe.verify(tmp_path / "epoch=1.ckpt")
    assert shardsafe.load(tmp_path / "epoch=1.ckpt")["step"] == 3
    # a link whose checkpoint is gone: the link goes too
    (tmp_path / "last.ckpt").symlink_to("epoch=1.ckpt")
    shardsafe.delete(tmp_path / "epoch=1.ckpt")
    shardsafe.delete(f"file://{tmp_path / 'last.ckpt'}")
    assert _tree(tmp_path) == []


def test_a_link_to_something_else_is_refused(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    (tmp_path / "link").symlink_to("mine")
    before = _tree(tmp_path)
    with pytest.raises(shardsafe.InvalidArgumentError, match="not a shardsafe checkpoint"):
        shardsafe.delete(tmp_path / "link")
    assert _tree(tmp_path) == before


def test_an_interrupted_deletion_is_finished(tmp_path: Path) -> None:
    _save(tmp_path / "c")
    os.rename(tmp_path / "c" / "MANIFEST.json", tmp_path / "c" / TOMBSTONE)  # crashed after the first step
    shardsafe.delete(tmp_path / "c")
    assert _tree(tmp_path) == []


def test_an_incremental_base_keeps_the_files_its_referrer_needs(tmp_path: Path) -> None:
    big = {"w": torch.arange(4096, dtype=torch.float32), "v": torch.zeros(4096)}
    shardsafe.save(tmp_path / "s1", big)
    shardsafe.save(tmp_path / "s2", {**big, "v": torch.ones(4096)}, base=str(tmp_path / "s1"))
    shardsafe.delete(tmp_path / "s1")
    assert (tmp_path / "s1" / TOMBSTONE).exists()  # retired: s2 refers to its data file
    assert torch.equal(shardsafe.load(tmp_path / "s2")["w"], big["w"])
    shardsafe.delete(tmp_path / "s2")  # the last referrer: both go
    assert _tree(tmp_path) == []


def _racer(path: Path, start: threading.Barrier, results: list[str]) -> None:
    start.wait(30)
    try:
        shardsafe.delete(path)
        results.append("deleted")
    except shardsafe.CheckpointNotFoundError:
        results.append("gone")
    except BaseException as err:  # reported to the test
        results.append(f"{type(err).__name__}: {err}")


@pytest.mark.timeout(60)
def test_callers_deleting_the_same_checkpoint_at_once_converge(tmp_path: Path) -> None:
    """As on every rank of a job that calls it by mistake: each call deletes or finds it gone."""
    for r in range(5):
        path = tmp_path / f"c{r}"
        _save(path)
        _save(tmp_path / "keep", float(r + 2), overwrite=True)
        start = threading.Barrier(4)
        results: list[str] = []
        threads = [threading.Thread(target=_racer, args=(path, start, results)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert set(results) <= {"deleted", "gone"} and "deleted" in results and len(results) == 4, results
        assert not path.exists()
        shardsafe.verify(tmp_path / "keep")


def test_a_hung_storage_ends_the_call_at_its_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shardsafe.storage.local import LocalStorage

    _save(tmp_path / "c")
    release = threading.Event()
    real = LocalStorage.unlink_names

    def hung(self: LocalStorage, directory: str, names: list[str]) -> None:
        release.wait(30)
        real(self, directory, names)

    monkeypatch.setattr(LocalStorage, "unlink_names", hung)
    t0 = time.monotonic()
    with pytest.raises(shardsafe.CheckpointTimeoutError, match="deleting the checkpoint"):
        shardsafe.delete(tmp_path / "c", timeout=0.5)
    assert time.monotonic() - t0 < 10
    assert not (tmp_path / "c" / "MANIFEST.json").exists()  # set aside before the data files
    with pytest.raises(shardsafe.CheckpointNotFoundError):
        shardsafe.load(tmp_path / "c")
    release.set()
    monkeypatch.setattr(LocalStorage, "unlink_names", real)
    deadline = time.monotonic() + 10
    while (tmp_path / "c").exists() and time.monotonic() < deadline:  # the abandoned call finishes
        time.sleep(0.05)
    if (tmp_path / "c").exists():
        shardsafe.delete(tmp_path / "c")
    assert _tree(tmp_path) == []


def test_storage_options_are_accepted_for_local_paths_and_checked(tmp_path: Path) -> None:
    opts = {"anon": True}
    shardsafe.save(tmp_path / "c", {"w": torch.ones(2)}, storage_options=opts)
    shardsafe.async_save(tmp_path / "d", {"w": torch.ones(2)}, storage_options=opts).wait()
    shardsafe.verify(tmp_path / "c", storage_options=opts)
    shardsafe.inspect(tmp_path / "d", storage_options=opts)
    state = {"w": torch.zeros(2)}
    shardsafe.load(tmp_path / "c", state, storage_options=opts)
    assert torch.equal(state["w"], torch.ones(2))
    shardsafe.delete(tmp_path / "d", storage_options=opts)
    with pytest.raises(shardsafe.InvalidTypeError, match="storage_options must be a dict"):
        shardsafe.load(tmp_path / "c", storage_options="anon")  # type: ignore[arg-type]
    # a URL hands them to its fsspec filesystem
    from shardsafe.storage import get_storage

    assert get_storage(f"file://{tmp_path}", {"auto_mkdir": True}).fs.auto_mkdir is True  # type: ignore[attr-defined]
    assert get_storage(f"file://{tmp_path}", {"auto_mkdir": False}).fs.auto_mkdir is False  # type: ignore[attr-defined]
    shardsafe.delete(f"file://{tmp_path / 'c'}", storage_options={"auto_mkdir": False})
    assert _tree(tmp_path) == []


@pytest.mark.timeout(120)
def test_on_an_object_store(s3_server: S3Server, s3_bucket: str) -> None:
    import s3fs

    opts = s3_server.storage_options
    url = f"s3://{s3_bucket}/run/step-1"
    _save(url, 1.0, storage_options=opts)
    _save(f"s3://{s3_bucket}/run/step-2", 2.0, storage_options=opts)
    fs = s3fs.S3FileSystem(**opts, skip_instance_cache=True)
    fs.pipe(f"{s3_bucket}/run/other/notes.txt", b"mine")
    with pytest.raises(shardsafe.CheckpointNotFoundError, match="refusing to delete"):
        shardsafe.delete(f"s3://{s3_bucket}/run/other", storage_options=opts)
    shardsafe.delete(url, storage_options=opts)
    fs.invalidate_cache()
    assert not fs.exists(f"{s3_bucket}/run/step-1/MANIFEST.json")
    assert [p.rsplit("/", 1)[1] for p in fs.ls(f"{s3_bucket}/run")] == ["other", "step-2"]
    assert fs.cat(f"{s3_bucket}/run/other/notes.txt") == b"mine"
    assert shardsafe.load(f"s3://{s3_bucket}/run/step-2", storage_options=opts)["step"] == 2


def test_no_thread_outlives_the_call(tmp_path: Path) -> None:
    """Lightning's test suite fails a test that leaves a thread running: delete joins the one it starts."""
    for i in range(20):
        _save(tmp_path / f"c{i}")
    before = set(threading.enumerate())
    for i in range(20):
        shardsafe.delete(tmp_path / f"c{i}")
        left = set(threading.enumerate()) - before
        assert not left, left
