"""A delete of a base checkpoint (retention, possibly in another process) racing an incremental save
that refers to it, interleaved at each step: whichever comes first, every committed checkpoint
verifies. The two sides write their intent before they look at the other's: the save stages its
manifest before checking its bases (still committed, no tombstone, every referred file there); the
delete writes its tombstone before reading which files staged and committed siblings refer to."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.catalog import delete as delete_rule
from shardsafe.catalog.delete import delete_checkpoint
from shardsafe.engine import commit as engine_commit
from shardsafe.storage.local import LocalStorage


def _state(changed: float) -> dict[str, Any]:
    """Three tensors that never change (referred to by the incremental save) and one that does."""
    return {f"frozen{i}": torch.full((4096,), float(i)) for i in range(3)} | {"w": torch.full((16,), changed)}


def _committed(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if (p / "MANIFEST.json").exists())


def _every_committed_checkpoint_verifies(root: Path) -> None:
    for path in _committed(root):
        shardsafe.verify(path)
        got = shardsafe.load(path)
        assert torch.equal(got["frozen2"], torch.full((4096,), 2.0)), path


def test_a_delete_run_between_the_saves_check_and_its_commit_keeps_what_the_save_refers_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The save has checked its base; before it publishes, retention deletes the base whole (a slow
    save, a fast delete). The delete must see the staged manifest and keep the referred files."""
    base, new = tmp_path / "step-1", tmp_path / "step-2"
    shardsafe.save(base, _state(1.0))
    real = engine_commit.check_ref_files
    ran: list[list[str]] = []

    def check_then_delete_the_base(*args: Any, **kwargs: Any) -> None:
        real(*args, **kwargs)
        ran.append(delete_checkpoint(LocalStorage(), str(base)))

    monkeypatch.setattr(engine_commit, "check_ref_files", check_then_delete_the_base)
    shardsafe.save(new, _state(2.0), base=str(base))
    assert len(ran) == 1 and not (base / "MANIFEST.json").exists()  # the base is deleted, as asked
    assert json.loads((new / "MANIFEST.json").read_text())["refs"]  # an incremental save, committed
    _every_committed_checkpoint_verifies(tmp_path)
    assert torch.equal(shardsafe.load(new)["frozen0"], torch.zeros(4096))


def test_a_save_run_between_the_deletes_scan_and_its_unlinks_does_not_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The delete has written its tombstone and read which files siblings refer to (none); before it
    unlinks, an incremental save on that base runs whole (a slow unlink, a fast save). The save must
    see the tombstone and fail, committing nothing; the delete then goes on."""
    base, new = tmp_path / "step-1", tmp_path / "step-2"
    shardsafe.save(base, _state(1.0))
    real = delete_rule.unlink.remove
    outcomes: list[str] = []

    def save_before_the_unlinks(storage: Any, directory: str, names: Any, **kwargs: Any) -> Any:
        if directory == str(base) and not outcomes:
            try:
                shardsafe.save(new, _state(2.0), base=str(base))
                outcomes.append("committed")
            except shardsafe.CheckpointError as err:  # refused at its start: the tombstone is there
                outcomes.append(f"refused: {err}")
        return real(storage, directory, names, **kwargs)

    monkeypatch.setattr(delete_rule.unlink, "remove", save_before_the_unlinks)
    delete_checkpoint(LocalStorage(), str(base))
    assert len(outcomes) == 1 and outcomes[0].startswith("refused"), outcomes
    assert not (new / "MANIFEST.json").exists() and not [n for n in os.listdir(tmp_path) if ".staging-" in n]
    _every_committed_checkpoint_verifies(tmp_path)


def test_a_delete_that_begins_while_the_save_builds_its_manifest_and_unlinks_after_it_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The save has accepted its base; while it builds its manifest, a delete in another thread writes
    the tombstone and reads the references (the save's manifest is not staged yet: none), then stalls
    before its unlinks until the save is over. The save, checking after staging, must see the tombstone
    and fail; had it committed, the unlinks that follow would leave it pointing at nothing."""
    base, new = tmp_path / "step-1", tmp_path / "step-2"
    shardsafe.save(base, _state(1.0))
    at_unlink, save_over = threading.Event(), threading.Event()
    real_unlink, real_build = delete_rule.unlink.remove, engine_commit.build_manifest
    errors: list[BaseException] = []

    def stalled_unlink(storage: Any, directory: str, names: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is deleter:  # the failed save's own discard goes through at once
            at_unlink.set()
            assert save_over.wait(60)
        return real_unlink(storage, directory, names, **kwargs)

    def delete_base() -> None:
        try:
            delete_checkpoint(LocalStorage(), str(base))
        except BaseException as err:  # reported by the test, not lost with the thread
            errors.append(err)

    deleter = threading.Thread(target=delete_base, daemon=True)

    def build_while_the_delete_begins(*args: Any, **kwargs: Any) -> Any:
        deleter.start()
        assert at_unlink.wait(60)
        return real_build(*args, **kwargs)

    monkeypatch.setattr(delete_rule.unlink, "remove", stalled_unlink)
    monkeypatch.setattr(engine_commit, "build_manifest", build_while_the_delete_begins)
    try:
        with pytest.raises(shardsafe.CheckpointNotFoundError, match="being deleted"):
            shardsafe.save(new, _state(2.0), base=str(base))
    finally:
        save_over.set()
        deleter.join(60)
    assert not errors and not deleter.is_alive()
    assert not (new / "MANIFEST.json").exists() and not [n for n in os.listdir(tmp_path) if ".staging-" in n]
    _every_committed_checkpoint_verifies(tmp_path)
