"""A plain ``save`` over a checkpoint removes the data files there that no save will ever commit: what
another writer's save of the same path left when it never committed (or a crash between moving its
data files in and committing). Only once unchanged for ``SHARDSAFE_LEFTOVER_AGE_SECONDS``, and never a
file a manifest lists, a sibling refers to, or a save in flight may still be writing."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.catalog.names import data_file, pending_name, temp_manifest

HOUR = 3600.0


def _state(value: float) -> dict[str, Any]:
    return {"w": torch.full((64,), value), "b": torch.full((8,), -value)}


def _save_id(age: float) -> str:
    """A save id of shardsafe's making (start time, 10 hex digits) for a save that began ``age`` ago."""
    return f"{int(time.time() - age)}{'ab12cd34ef'}"


def _leave(folder: Path, save_id: str, age: float) -> Path:
    """What another writer's save ``save_id`` left in ``folder`` without committing, unchanged for ``age``
    seconds: a real data file of that save id."""
    own = next(folder.glob("data-*.safetensors"))
    left = folder / data_file(0, save_id)
    shutil.copyfile(own, left)
    then = time.time() - age
    os.utime(left, (then, then))
    return left


def _overwrite_and_check(path: Path, value: float) -> None:
    shardsafe.save(str(path), _state(value), overwrite=True)
    shardsafe.verify(str(path))
    assert torch.equal(shardsafe.load(str(path))["w"], torch.full((64,), value))


def test_an_old_orphan_of_another_writer_goes_with_the_next_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    shardsafe.save(str(path), _state(1.0))
    left = _leave(path, _save_id(2 * HOUR), 2 * HOUR)
    _overwrite_and_check(path, 2.0)
    assert not left.exists()
    assert sorted(p.name for p in path.iterdir() if p.name.startswith("data-")) == [
        n for n in shardsafe.inspect(str(path)).files
    ]


@pytest.mark.parametrize(
    "save_age, file_age",
    [(2 * HOUR, 60.0), (60.0, 2 * HOUR)],
    ids=["written-recently", "save-began-recently"],
)
def test_a_young_orphan_stays(tmp_path: Path, save_age: float, file_age: float) -> None:
    """A save that began or wrote within the leftover age may still be in flight (on an object store
    its data objects are in the target with nothing else to show for it)."""
    path = tmp_path / "ck"
    shardsafe.save(str(path), _state(1.0))
    left = _leave(path, _save_id(save_age), file_age)
    _overwrite_and_check(path, 2.0)
    assert left.exists()


@pytest.mark.parametrize("sign", ["pending directory", "temporary manifest"])
def test_the_files_of_a_save_in_flight_stay_however_old(tmp_path: Path, sign: str) -> None:
    path = tmp_path / "ck"
    shardsafe.save(str(path), _state(1.0))
    sid = _save_id(2 * HOUR)
    left = _leave(path, sid, 2 * HOUR)
    if sign == "pending directory":
        (tmp_path / pending_name("ck", sid)).mkdir()
    else:
        (path / temp_manifest(sid)).write_bytes(b"{}")
    _overwrite_and_check(path, 2.0)
    assert left.exists()


def test_files_a_sibling_refers_to_stay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An overwrite keeps the old data files an incremental sibling refers to: no manifest of their
    folder lists them, yet they are not orphans. With a leftover age near 0, every unlisted file is a
    candidate; the sibling's references keep them."""
    monkeypatch.setenv("SHARDSAFE_LEFTOVER_AGE_SECONDS", "0.01")
    a, b = tmp_path / "a", tmp_path / "b"
    shardsafe.save(str(a), _state(1.0))
    shardsafe.save(str(b), _state(1.0), base=str(a))  # refers to a's files for every chunk
    before = {p.name for p in a.glob("data-*")}
    _overwrite_and_check(a, 2.0)
    time.sleep(1.1)  # a save id carries its start time in whole seconds
    _overwrite_and_check(a, 3.0)  # the second overwrite sees the first one's kept files as unlisted
    assert before <= {p.name for p in a.glob("data-*")}
    shardsafe.verify(str(b))
    assert torch.equal(shardsafe.load(str(b))["w"], torch.full((64,), 1.0))


def test_the_manager_cleanup_keeps_a_save_in_flight_of_another_process(tmp_path: Path) -> None:
    """The manager's sweep of a committed checkpoint uses the same rule: an unlisted old file whose save
    still has its pending directory beside the checkpoint stays."""
    root = tmp_path / "run"
    with shardsafe.CheckpointManager(str(root), leftover_age=HOUR) as mgr:
        mgr.save(1, _state(1.0))
        step = next(p for p in root.iterdir() if not p.name.startswith("."))
        sid = _save_id(2 * HOUR)
        in_flight = _leave(step, sid, 2 * HOUR)
        (root / pending_name(step.name, sid)).mkdir()
        orphan = _leave(step, _save_id(3 * HOUR), 3 * HOUR)
        mgr.save(2, _state(2.0))  # a commit runs the sweep of leftovers
    assert in_flight.exists() and not orphan.exists()


def _meanwhile(monkeypatch: pytest.MonkeyPatch, make: Any) -> None:
    """Run ``make()`` while the next save builds its manifest: a save refuses a target holding names or
    kinds of entries it does not write (principle 9), so such entries can only appear while one runs
    (someone else writing there), which is what its sweep then meets."""
    from shardsafe.engine import commit

    real = commit.fault_point

    def meanwhile(point: str, rank: int | None = None) -> None:
        if point == "save.commit":
            make()
        real(point, rank)

    monkeypatch.setattr(commit, "fault_point", meanwhile)


def test_a_symbolic_link_named_like_a_data_file_stays(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing is removed through a link, nor the link itself (shardsafe did not write it): a link that
    looks like an old orphan stays, and so does what it points to; a real orphan beside it goes."""
    path = tmp_path / "ck"
    shardsafe.save(str(path), _state(1.0))
    outside = tmp_path / "kept.bin"
    outside.write_bytes(b"not shardsafe's")
    link = path / data_file(0, _save_id(3 * HOUR))
    then = time.time() - 3 * HOUR
    os.utime(outside, (then, then))

    def make() -> None:
        link.symlink_to(outside)
        os.utime(link, (then, then), follow_symlinks=False)

    _meanwhile(monkeypatch, make)
    orphan = _leave(path, _save_id(2 * HOUR), 2 * HOUR)
    _overwrite_and_check(path, 2.0)
    assert link.is_symlink() and outside.read_bytes() == b"not shardsafe's"
    assert not orphan.exists()


def test_a_folder_named_like_a_data_file_stays_and_does_not_block_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ck"
    shardsafe.save(str(path), _state(1.0))
    orphan = _leave(path, _save_id(2 * HOUR), 2 * HOUR)
    folder = path / data_file(0, _save_id(3 * HOUR))  # sorts before the orphan
    then = time.time() - 3 * HOUR

    def make() -> None:
        folder.mkdir()
        os.utime(folder, (then, then))

    _meanwhile(monkeypatch, make)
    _overwrite_and_check(path, 2.0)
    assert folder.is_dir() and not orphan.exists()


def test_files_shardsafe_did_not_write_stay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save refuses a folder holding foreign files, so they can only appear while it runs (someone
    else writing there): the sweep after its commit leaves them, however old, and names that merely
    start like a data file too."""
    from shardsafe.engine import commit

    path = tmp_path / "ck"
    shardsafe.save(str(path), _state(1.0))
    orphan = _leave(path, _save_id(2 * HOUR), 2 * HOUR)
    sid = _save_id(3 * HOUR)
    foreign = [path / "notes.txt", path / f"{data_file(0, sid)}.part", path / f"x{data_file(0, sid)}"]
    real = commit.fault_point

    def meanwhile(point: str, rank: int | None = None) -> None:
        if point == "save.commit":
            then = time.time() - 3 * HOUR
            for f in foreign:
                f.write_bytes(b"mine")
                os.utime(f, (then, then))
        real(point, rank)

    monkeypatch.setattr(commit, "fault_point", meanwhile)
    _overwrite_and_check(path, 2.0)
    assert all(f.read_bytes() == b"mine" for f in foreign)
    assert not orphan.exists()


def _old_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A committed checkpoint elsewhere whose save began over a second ago (the leftover age is set
    near 0, and a save id carries its start time in whole seconds) and whose files look old."""
    monkeypatch.setenv("SHARDSAFE_LEFTOVER_AGE_SECONDS", "0.01")
    other = tmp_path / "other"
    shardsafe.save(str(other), _state(7.0))
    then = time.time() - 2 * HOUR
    for f in other.iterdir():
        os.utime(f, (then, then))
    time.sleep(1.1)
    return other


def test_files_a_manifest_committed_meanwhile_lists_stay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second writer of the path commits right after this save's publish, before its sweep: the
    current manifest is the second writer's, and its files (old, of a save that began long ago) stay."""
    from shardsafe.storage.local import LocalStorage

    path = tmp_path / "ck"
    shardsafe.save(str(path), _state(1.0))
    other = _old_checkpoint(tmp_path, monkeypatch)
    real = LocalStorage.publish

    def publish(self: LocalStorage, commit: Any, **kwargs: Any) -> bytes | None:
        old = real(self, commit, **kwargs)
        for f in other.glob("data-*"):  # the second writer moves its files in, then commits
            shutil.copy2(f, path / f.name)
        (path / ".MANIFEST.json.second").write_bytes((other / "MANIFEST.json").read_bytes())
        os.replace(path / ".MANIFEST.json.second", path / "MANIFEST.json")
        return old

    monkeypatch.setattr(LocalStorage, "publish", publish)
    shardsafe.save(str(path), _state(2.0), overwrite=True)
    monkeypatch.undo()
    shardsafe.verify(str(path))
    assert torch.equal(shardsafe.load(str(path))["w"], torch.full((64,), 7.0))


def test_files_a_tombstone_lists_stay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The files of a deletion under way in the folder (its tombstone lists them) are the deletion's to
    remove (it keeps those other checkpoints still refer to), not the orphan sweep's."""
    path = tmp_path / "ck"
    shardsafe.save(str(path), _state(1.0))
    other = _old_checkpoint(tmp_path, monkeypatch)
    retired = sorted(f.name for f in other.glob("data-*"))
    for name in retired:
        shutil.copy2(other / name, path / name)
    (path / ".MANIFEST.json.deleting").write_bytes((other / "MANIFEST.json").read_bytes())
    _overwrite_and_check(path, 2.0)
    assert all((path / name).exists() for name in retired)
