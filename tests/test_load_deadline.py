"""A load whose reads hang (a stuck network filesystem) raises at its deadline instead of blocking."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.storage.local import LocalStorage


def test_hung_read_raises_at_the_deadline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shardsafe.save(tmp_path / "c", {"w": torch.arange(1000.0)})
    release = threading.Event()
    real = LocalStorage.read_into

    def hung(self: LocalStorage, path: str, offset: int, out: memoryview) -> None:
        release.wait(30)  # the read blocks until the test lets it go
        real(self, path, offset, out)

    monkeypatch.setattr(LocalStorage, "read_into", hung)
    state: dict[str, Any] = {"w": torch.zeros(1000)}
    started = time.monotonic()
    try:
        with pytest.raises(shardsafe.CheckpointError, match=r"reads did not finish within 1s"):
            shardsafe.load(tmp_path / "c", state, timeout=1)
        assert time.monotonic() - started < 10
    finally:
        release.set()
    monkeypatch.undo()
    shardsafe.load(tmp_path / "c", state)  # nothing poisoned: the next load works
    assert torch.equal(state["w"], torch.arange(1000.0))
