"""shardsafe deletes only what it wrote.

- A save target that holds anything but shardsafe's own files is refused with
  ``CheckpointExistsError`` naming some of them, whatever ``overwrite=`` says, and nothing in it
  changes (local, ``file://`` and ``memory://`` paths; the working directory itself).
- An overwrite removes the old checkpoint's files by the names its manifest lists only after that
  manifest passed the loader's validation, and only data-file names: a hostile old manifest naming
  ``../victim.txt`` (re-sealed, so its own checksum passes) deletes nothing.
- Deleting a checkpoint uncommits it first (the manifest becomes a tombstone, the folder is fsynced
  before any data file goes): a crash in the middle leaves an uncommitted folder, which a later
  cleanup finishes from the same validated names, sparing anything else.
- Cleanup of crashed saves removes a staging directory's own files only, and never touches the
  litter directories older versions made (what they hold was never checked).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.catalog.delete import delete_checkpoint, finish_deletion
from shardsafe.format.manifest import seal_manifest
from shardsafe.manager.cleanup import remove_leftovers
from shardsafe.manager.listing import scan
from shardsafe.storage.local import LocalStorage

STATE = {"x": torch.arange(6.0), "step": 1}


def _snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (``None`` for a folder)."""
    out: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = None
        for f in filenames:
            out[os.path.relpath(os.path.join(dirpath, f), root)] = Path(dirpath, f).read_bytes()
    return out


def _user_folder(path: Path) -> None:
    path.mkdir(parents=True)
    (path / "results.csv").write_text("epoch,loss\n1,0.5\n")
    (path / ".env").write_text("SECRET=1")
    (path / "plots").mkdir()
    (path / "plots" / "loss.png").write_bytes(b"\x89PNG")


@pytest.fixture(params=["local", "file", "memory"])
def where(request: Any, tmp_path: Path) -> Iterator[tuple[str, Path | None]]:
    """(URL prefix for targets, local folder behind it or None for memory://)."""
    if request.param == "local":
        yield str(tmp_path), tmp_path
    elif request.param == "file":
        yield f"file://{tmp_path}", tmp_path
    else:
        import fsspec

        bucket = f"memory://t-{uuid.uuid4().hex[:8]}"
        yield bucket, None
        fsspec.filesystem("memory").rm(bucket.removeprefix("memory://"), recursive=True)


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_folder_of_user_files_is_refused_and_left_as_it_was(where: tuple[str, Path | None], overwrite: bool) -> None:
    base, local = where
    if local is None:
        import fsspec

        fs = fsspec.filesystem("memory")
        root = base.removeprefix("memory://") + "/results"
        fs.pipe_file(f"{root}/results.csv", b"epoch,loss\n")
        fs.pipe_file(f"{root}/plots/loss.png", b"\x89PNG")
        before: Any = sorted(fs.find(root))
    else:
        _user_folder(local / "results")
        before = _snapshot(local)
    with pytest.raises(shardsafe.CheckpointExistsError) as info:
        shardsafe.save(f"{base}/results", STATE, overwrite=overwrite)
    assert isinstance(info.value, FileExistsError)
    assert "results.csv" in str(info.value) and "plots" in str(info.value), str(info.value)
    after = sorted(fs.find(root)) if local is None else _snapshot(local)
    assert after == before  # nothing added, removed or changed (no staging left either)


@pytest.mark.parametrize("overwrite", [False, True])
def test_saving_to_the_working_directory_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overwrite: bool
) -> None:
    work = tmp_path / "project"
    _user_folder(work)
    (work / "train.py").write_text("print('hi')")
    monkeypatch.chdir(work)
    before = _snapshot(tmp_path)
    for path in (os.getcwd(), ".", ""):
        with pytest.raises(shardsafe.CheckpointExistsError, match=r"train\.py|empty path"):
            shardsafe.save(path, STATE, overwrite=overwrite)
    assert _snapshot(tmp_path) == before


def test_a_file_is_refused_and_an_empty_folder_is_used(tmp_path: Path) -> None:
    (tmp_path / "model.bin").write_bytes(b"weights")
    with pytest.raises(shardsafe.CheckpointExistsError, match="not a directory"):
        shardsafe.save(str(tmp_path / "model.bin"), STATE, overwrite=True)
    assert (tmp_path / "model.bin").read_bytes() == b"weights"
    (tmp_path / "empty").mkdir()
    shardsafe.save(str(tmp_path / "empty"), STATE)
    assert shardsafe.load(str(tmp_path / "empty"))["step"] == 1


def _rewrite_manifest(manifest: Path, files: dict[str, Any]) -> None:
    """Replace the listed files of a committed manifest and re-seal it, as a hostile author would."""
    doc = json.loads(manifest.read_bytes())
    doc["files"].update(files)
    manifest.write_bytes(json.dumps(seal_manifest(doc)).encode())


@pytest.mark.parametrize("kind", ["local", "file"])
def test_a_hostile_old_manifest_makes_an_overwrite_delete_nothing_outside(tmp_path: Path, kind: str) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    ckpt = tmp_path / "ckpt"
    url = str(ckpt) if kind == "local" else f"file://{ckpt}"
    shardsafe.save(url, STATE)
    entry = {"size": 8, "header_bytes": 8, "header_checksum": "0" * 16, "index_checksum": None}  # v3: 4 fields
    _rewrite_manifest(ckpt / "MANIFEST.json", {"../victim.txt": entry})
    shardsafe.save(url, {**STATE, "step": 2}, overwrite=True)
    assert victim.read_text() == "precious"
    shardsafe.verify(url)
    assert shardsafe.load(url)["step"] == 2


def test_an_old_manifest_listing_other_names_inside_deletes_only_data_files(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shardsafe.save(str(ckpt), STATE)
    old_data = [n for n in os.listdir(ckpt) if n.startswith("data-")]
    entry = {"size": 8, "header_bytes": 8, "header_checksum": "0" * 16, "index_checksum": None}  # v3: 4 fields
    _rewrite_manifest(ckpt / "MANIFEST.json", {"MANIFEST.json": entry, "keep.me": entry})  # valid plain names
    shardsafe.save(str(ckpt), {**STATE, "step": 2}, overwrite=True)
    shardsafe.verify(str(ckpt))  # its own manifest was not deleted
    assert not any((ckpt / n).exists() for n in old_data)  # the old data files went, as listed


class _Recording(LocalStorage):
    """Records the delete primitives in order; optionally fails the first data-file removal."""

    def __init__(self, fail_data: bool = False) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.fail_data = fail_data

    def retire_manifest(self, path: str, tombstone: str) -> None:
        self.calls.append("retire")
        super().retire_manifest(path, tombstone)

    def sync_dir(self, directory: str) -> None:
        self.calls.append("sync")
        super().sync_dir(directory)

    def unlink_names(self, directory: str, names: list[str]) -> None:
        self.calls.append("unlink " + ",".join(n.split("-")[0] for n in names))
        if self.fail_data and names[0].startswith("data-"):
            raise OSError(5, "Input/output error (injected)", directory)
        super().unlink_names(directory, names)


def test_an_interrupted_delete_never_looks_committed_and_is_finished_later(tmp_path: Path) -> None:
    ckpt = tmp_path / "step-00000001"
    shardsafe.save(str(ckpt), STATE)
    (ckpt / "notes.txt").write_text("not shardsafe's")
    crashing = _Recording(fail_data=True)
    with pytest.raises(OSError, match="injected"):
        delete_checkpoint(crashing, str(ckpt))
    # the manifest went first, in one step, and was made durable before any data file was touched
    assert crashing.calls[:3] == ["retire", "sync", "unlink data"], crashing.calls
    assert not (ckpt / "MANIFEST.json").exists()
    with pytest.raises(shardsafe.CheckpointNotFoundError):
        shardsafe.load(str(ckpt))
    assert [r.status for r in scan(LocalStorage(), str(tmp_path))] == ["incomplete"]
    finishing = _Recording()
    assert finish_deletion(finishing, str(ckpt))  # the tombstone's validated names
    assert sorted(os.listdir(ckpt)) == ["notes.txt"]  # the folder stays: it is not empty


def test_a_delete_refuses_a_manifest_that_does_not_validate(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    ckpt = tmp_path / "ckpt"
    shardsafe.save(str(ckpt), STATE)
    entry = {"size": 8, "header_bytes": 8, "header_checksum": "0" * 16, "index_checksum": None}  # v3: 4 fields
    _rewrite_manifest(ckpt / "MANIFEST.json", {"../victim.txt": entry})
    before = _snapshot(tmp_path)
    with pytest.raises(shardsafe.CorruptCheckpointError, match="victim"):
        delete_checkpoint(LocalStorage(), str(ckpt))
    assert _snapshot(tmp_path) == before


def test_cleanup_removes_only_a_staging_directorys_own_files_and_never_litter(tmp_path: Path) -> None:
    shardsafe.save(str(tmp_path / "step-00000001"), STATE)
    old = time.time() - 7200
    staging = tmp_path / ".step-00000002.staging-deadbeef"
    staging.mkdir()
    for name in ("data-00001-deadbeef.safetensors", "MANIFEST.json", "data-00001-cafe.safetensors", "mine.txt"):
        (staging / name).write_bytes(b"x")
    litter = tmp_path / ".step-00000003.litter-1a2b3c4d"
    litter.mkdir()
    (litter / "user.txt").write_text("moved aside by an older version")
    for p in (*staging.iterdir(), staging, litter / "user.txt", litter):
        os.utime(p, (old, old))
    records = scan(LocalStorage(), str(tmp_path))
    removed = remove_leftovers(LocalStorage(), LocalStorage(), records, min_age=60)
    assert removed == []  # the staging directory is not empty afterwards, so it stays
    assert sorted(os.listdir(staging)) == ["data-00001-cafe.safetensors", "mine.txt"]  # another save id's, a user's
    assert (litter / "user.txt").read_text() == "moved aside by an older version"
