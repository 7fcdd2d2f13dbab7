"""The data files an overwrite keeps for incremental checkpoints (format v2) go with their last
referrer (storage/delete.py, docs/incremental.md "Moving, deleting and overwriting"): an overwrite of
a base keeps its old files while a sibling refers to them; deleting the last such sibling removes
them, and nothing else: hostile referrers, saves in flight, other referrers and crashes at every
step of the delete leave every committed checkpoint loadable."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.format.manifest import seal_manifest
from shardsafe.manager.listing import scan
from shardsafe.storage.base import Storage
from shardsafe.storage.delete import delete_checkpoint, finish_deletion
from shardsafe.storage.local import LocalStorage
from shardsafe.storage.names import TOMBSTONE

ROWS = 16


def state_at(step: int) -> dict[str, Any]:
    """Three frozen tensors and one that changes with ``step``."""
    g = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {f"frozen{i}": torch.randn(ROWS, 64, generator=g) for i in range(3)}
    out["train"] = torch.full((ROWS, 64), float(step))
    out["step"] = step
    return out


OTHER = {"fresh": torch.full((8,), 7.0), "step": 99}


def holds(path: str | Path, state: dict[str, Any]) -> None:
    out = shardsafe.load(path)
    assert sorted(out) == sorted(state), path
    for k, v in state.items():
        assert torch.equal(out[k], v) if isinstance(v, torch.Tensor) else out[k] == v, (path, k)
    shardsafe.verify(path)


def save_id(path: Path) -> str:
    sid: str = json.loads((path / "MANIFEST.json").read_text())["save_id"]
    return sid


def data(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name.startswith("data-")) if path.exists() else []


def overwritten_base(tmp_path: Path) -> tuple[list[str], list[str]]:
    """b full, c incremental on b, b overwritten: (b's old data files, b's new ones)."""
    shardsafe.save(tmp_path / "b", state_at(1))
    old = data(tmp_path / "b")
    shardsafe.save(tmp_path / "c", state_at(2), base=tmp_path / "b")
    assert json.loads((tmp_path / "c" / "MANIFEST.json").read_text())["refs"]["b"]["files"].keys() == set(old)
    shardsafe.save(tmp_path / "b", OTHER, overwrite=True)
    new = data(tmp_path / "b")
    assert set(old) < set(new)  # kept for c, beside b's new files
    holds(tmp_path / "c", state_at(2))
    return old, [n for n in new if n not in old]


def test_deleting_the_last_referrer_removes_the_files_an_overwrite_kept(tmp_path: Path) -> None:
    old, new = overwritten_base(tmp_path)
    delete_checkpoint(LocalStorage(), str(tmp_path / "c"))
    assert not (tmp_path / "c").exists()
    assert data(tmp_path / "b") == new  # the old save's files went with their last referrer
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == sorted([*new, "MANIFEST.json"])
    holds(tmp_path / "b", OTHER)
