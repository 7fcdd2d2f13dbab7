"""The storage refuses the commit: a filesystem remounted read-only (``EROFS``), or one that answers
``EACCES``/``EPERM``, at the final rename of a save (or at the moves of its data files just before).

What holds: the save raises a ``CheckpointError`` naming the path and the fix; nothing is committed
and the previous checkpoint stays whole and loadable. When the storage still lets the save remove what
it wrote, no pending directory and no data file of it are left. When it refuses that too (a read-only
filesystem refuses every change), they stay, never read; the next save of this process that commits
beside them removes them at once, and any save of that path or a manager's cleanup removes them once
older than the leftover age."""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.engine import unremoved


def _state(value: float) -> dict[str, Any]:
    return {"w": torch.full((64,), value), "b": torch.full((8,), -value)}


@dataclass
class Storage:
    """``os`` under ``root`` as a filesystem that refuses with ``code`` at the step ``at`` of a commit
    (``"manifest"``: the rename of the staged manifest over ``MANIFEST.json``; ``"data"``: the first
    move of a data file into the target; ``"folder"``: the rename of a pending directory to a new
    target). With ``remount``, every change under ``root`` is refused from then on (a read-only
    remount); otherwise only that one call fails."""

    root: Path
    at: str
    code: int = errno.EROFS
    remount: bool = False
    read_only: bool = False
    refused: list[str] = field(default_factory=list)

    def _step(self, src: str, dst: str) -> bool:
        if ".staging-" not in src:
            return False
        if self.at == "manifest":
            return dst.endswith(os.sep + "MANIFEST.json") and ".staging-" not in dst
        if self.at == "data":
            return os.path.basename(src).startswith("data-") and ".staging-" not in dst
        return os.path.basename(src).startswith(".") and ".staging-" not in os.path.basename(dst)

    def _refuse(self, what: str, path: str) -> None:
        self.refused.append(f"{what} {path}")
        raise OSError(self.code, os.strerror(self.code), path)

    def wrap(self, fn: Any, what: str) -> Any:
        def call(src: Any, *args: Any, **kwargs: Any) -> Any:
            mine = str(src).startswith(str(self.root))
            if mine and self.read_only:
                self._refuse(what, str(src))
            if mine and what == "rename" and self._step(str(src), str(args[0])):
                self.read_only = self.remount
                self.at = ""  # only the first such step
                self._refuse(what, str(src))
            return fn(src, *args, **kwargs)

        return call


@pytest.fixture
def fresh() -> Iterator[None]:
    unremoved.forget_all()
    yield
    unremoved.forget_all()


def _refuse(monkeypatch: pytest.MonkeyPatch, fs: Storage) -> None:
    for name, what in [("rename", "rename"), ("replace", "rename"), ("unlink", "unlink"), ("rmdir", "rmdir")]:
        monkeypatch.setattr(os, name, fs.wrap(getattr(os, name), what))
    monkeypatch.setattr(os, "mkdir", fs.wrap(os.mkdir, "mkdir"))


def _refused_save(monkeypatch: pytest.MonkeyPatch, fs: Storage, save: Callable[[], Any]) -> shardsafe.CheckpointError:
    """Run ``save`` with ``fs`` refusing the changes it was made for; the error it must raise. The
    refusal is lifted before returning (writable again)."""
    _refuse(monkeypatch, fs)
    try:
        with pytest.raises(shardsafe.CheckpointError) as err:
            save()
    finally:
        monkeypatch.undo()
    return err.value


def _pending(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".staging-" in p.name)


def _loads(path: Path, value: float) -> None:
    shardsafe.verify(str(path))
    assert torch.equal(shardsafe.load(str(path))["w"], torch.full((64,), value))


def _unlisted(path: Path) -> set[str]:
    return {p.name for p in path.glob("data-*")} - set(shardsafe.inspect(str(path)).files)


def _check_error(err: BaseException, path: Path) -> None:
    assert isinstance(err, shardsafe.CheckpointError)
    text = str(err)
    assert str(path) in text and "nothing was committed" in text
    assert "writable again" in text, "the message names the fix for a refusing filesystem"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES, errno.EPERM], ids=["EROFS", "EACCES", "EPERM"])
@pytest.mark.parametrize("at", ["manifest", "data"])
def test_an_overwrite_refused_at_its_commit_leaves_nothing_and_the_old_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh: None, code: int, at: str
) -> None:
    path = tmp_path / "ck"
    shardsafe.save(str(path), _state(1.0))
    fs = Storage(tmp_path, at, code)
    err = _refused_save(monkeypatch, fs, lambda: shardsafe.save(str(path), _state(2.0), overwrite=True))
    assert fs.refused, "the refusal happened"
    _check_error(err, path)
    assert isinstance(err.__cause__, OSError) and err.__cause__.errno == code
    assert _pending(tmp_path) == [] and _unlisted(path) == set()
    _loads(path, 1.0)


@pytest.mark.timeout(60)
def test_a_new_checkpoint_refused_at_its_commit_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh: None
) -> None:
    path = tmp_path / "ck"
    fs = Storage(tmp_path, "folder")
    err = _refused_save(monkeypatch, fs, lambda: shardsafe.save(str(path), _state(2.0)))
    assert fs.refused
    _check_error(err, path)
    assert _pending(tmp_path) == [] and not path.exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("at", ["manifest", "data"])
def test_after_a_read_only_remount_the_next_save_of_this_process_removes_what_was_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh: None, at: str
) -> None:
    """The filesystem stays read-only after refusing the commit, so the failed save cannot remove its
    pending directory (nor the data files it moved in); the error says so. Once writable, the next save
    of the path removes them at once (they are this process's own failed save's), with the default
    leftover age of an hour."""
    path = tmp_path / "ck"
    shardsafe.save(str(path), _state(1.0))
    fs = Storage(tmp_path, at, remount=True)
    err = _refused_save(monkeypatch, fs, lambda: shardsafe.save(str(path), _state(2.0), overwrite=True))
    _check_error(err, path)  # writable again
    assert "could not be removed" in str(err)
    assert _pending(tmp_path), "a read-only filesystem refused the removal of the pending directory"
    _loads(path, 1.0)
    if at == "manifest":
        assert _unlisted(path), "the data files it moved in are in the folder, never read"

    shardsafe.save(str(path), _state(3.0), overwrite=True)
    assert _pending(tmp_path) == [] and _unlisted(path) == set()
    _loads(path, 3.0)


@pytest.mark.timeout(60)
def test_after_a_read_only_remount_the_managers_next_save_removes_what_was_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh: None
) -> None:
    """A manager saves each step to a new folder: what step 2's failed save left beside step 1 (its
    whole pending directory) goes with the save of step 3."""
    root = tmp_path / "run"
    with shardsafe.CheckpointManager(str(root)) as mgr:
        mgr.save(1, _state(1.0))
        fs = Storage(root, "folder", remount=True)
        _refused_save(monkeypatch, fs, lambda: mgr.save(2, _state(2.0)))
        assert _pending(root)
        assert (latest := mgr.latest()) is not None and latest.step == 1
        mgr.save(3, _state(3.0))
        assert _pending(root) == []
        assert (latest := mgr.latest()) is not None and latest.step == 3
    assert torch.equal(shardsafe.load(str(next(root.glob("*3"))))["w"], torch.full((64,), 3.0))


@pytest.mark.timeout(60)
def test_what_another_process_left_goes_once_older_than_the_leftover_age(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh: None
) -> None:
    """The process whose save failed ended before saving again: another one's save of the path removes
    the pending directory and the moved data files once they are older than the leftover age, and not
    before."""
    path = tmp_path / "ck"
    shardsafe.save(str(path), _state(1.0))
    fs = Storage(tmp_path, "manifest", remount=True)
    _refused_save(monkeypatch, fs, lambda: shardsafe.save(str(path), _state(2.0), overwrite=True))
    unremoved.forget_all()  # a new process
    left = _pending(tmp_path)
    assert left and _unlisted(path)

    shardsafe.save(str(path), _state(3.0), overwrite=True)  # the default age: an hour
    assert _pending(tmp_path) == left and _unlisted(path)
    _loads(path, 3.0)

    monkeypatch.setenv("SHARDSAFE_LEFTOVER_AGE_SECONDS", "0.01")
    time.sleep(1.1)  # a save id carries its start time in whole seconds
    shardsafe.save(str(path), _state(4.0), overwrite=True)
    assert _pending(tmp_path) == [] and _unlisted(path) == set()
    _loads(path, 4.0)
