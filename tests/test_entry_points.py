"""Every public entry point goes through one wrapper: whatever goes wrong underneath (a storage primitive
raising something nobody foresaw), the caller gets a CheckpointError naming the operation and the path,
with the original chained as its cause; a builtin ValueError or TypeError stays one too."""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.interop import hf
from shardsafe.storage.local import LocalStorage


class Surprise(Exception):
    """Something no code of shardsafe foresees."""


def _calls(tmp: Path) -> dict[str, Callable[[], Any]]:
    good = str(tmp / "good")
    model = torch.nn.Linear(2, 2)
    return {
        "save": lambda: shardsafe.save(tmp / "new", {"w": torch.zeros(2)}),
        "async_save": lambda: shardsafe.async_save(tmp / "new-async", {"w": torch.zeros(2)}).wait(),
        "load": lambda: shardsafe.load(good, {"w": torch.zeros(2)}),
        "verify": lambda: shardsafe.verify(good),
        "inspect": lambda: shardsafe.inspect(good),
        "export_torch": lambda: shardsafe.export_torch(good, str(tmp / "out.pt")),
        "manager.resume": lambda: shardsafe.CheckpointManager(tmp / "run", save_on_signals=()).resume({"m": model}),
    }


@pytest.mark.parametrize("name", list(_calls(Path("."))))
def test_a_surprise_underneath_reaches_the_caller_as_a_checkpoint_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    shardsafe.save(tmp_path / "good", {"w": torch.ones(2)})
    shardsafe.save(tmp_path / "run" / "step-00000001", {"m": torch.nn.Linear(2, 2)}, metadata={"step": 1})

    def boom(*_args: Any, **_kwargs: Any) -> Any:
        raise Surprise("a primitive failed in a way nobody foresaw")

    for method in ("read_bytes", "open_writer", "list_dir"):
        monkeypatch.setattr(LocalStorage, method, boom)
    with pytest.raises(shardsafe.CheckpointError) as info:
        _calls(tmp_path)[name]()
    chain = []
    cur: BaseException | None = info.value
    while cur is not None:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    assert any(isinstance(e, Surprise) for e in chain), (name, repr(info.value))


def test_a_builtin_value_error_underneath_stays_a_value_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shardsafe.save(tmp_path / "good", {"w": torch.ones(2)})

    def bad(*_args: Any, **_kwargs: Any) -> Any:
        raise ValueError("an argument nobody checked")

    monkeypatch.setattr(LocalStorage, "read_bytes", bad)
    with pytest.raises(ValueError) as info:
        shardsafe.inspect(tmp_path / "good")
    assert isinstance(info.value, shardsafe.CheckpointError) and "inspect of" in str(info.value)


@pytest.mark.parametrize(
    ("raised", "kind", "words"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), OSError, "free space"),
        (PermissionError(errno.EACCES, "Permission denied", "/x/y"), PermissionError, "permissions"),
        (OSError(errno.EROFS, "Read-only file system"), OSError, "read-only"),
    ],
)
def test_a_storage_refusal_underneath_keeps_its_os_error_kind_and_errno(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, raised: OSError, kind: type[OSError], words: str
) -> None:
    """A disk full or a permission error met where no code expects one reaches the caller as a
    :class:`shardsafe.StorageError` that is still the ``OSError`` it was: ``except OSError`` and
    ``err.errno == errno.ENOSPC`` keep working, and the message names the operation, path and fix."""
    shardsafe.save(tmp_path / "good", {"w": torch.ones(2)})

    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise raised

    monkeypatch.setattr(hf, "_write_shard", refuse)
    with pytest.raises(kind) as info:
        shardsafe.export_hf(tmp_path / "good", tmp_path / "out")
    err = info.value
    assert isinstance(err, shardsafe.StorageError) and isinstance(err, shardsafe.CheckpointError)
    assert err.errno == raised.errno and err.__cause__ is raised
    assert "export of" in str(err) and str(tmp_path / "good") in str(err) and words in str(err)
