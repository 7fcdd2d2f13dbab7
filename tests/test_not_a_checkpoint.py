"""A folder that is not a checkpoint is named for what it is, by load, verify and inspect and by the
``shardsafe`` command: a run root (points to ``shardsafe ls`` and its newest checkpoint), a DCP folder
and a Hugging Face folder (point to ``shardsafe import``), a retired incremental base (names the
checkpoints that keep it, and says it must not be removed), a checkpoint whose deletion was
interrupted, the leftovers of an uncommitted save, an unrelated folder, a file."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe import CheckpointManager, CheckpointNotFoundError
from shardsafe.cli import main
from shardsafe.cli.ls import ls_main


def _readers(path: Path) -> dict[str, Callable[[], object]]:
    return {
        "load": lambda: shardsafe.load(path),
        "load(state)": lambda: shardsafe.load(path, {"w": torch.zeros(4, 4)}, timeout=30),
        "verify": lambda: shardsafe.verify(path),
        "inspect": lambda: shardsafe.inspect(path),
    }


def _refused(path: Path, *words: str, never: tuple[str, ...] = ()) -> str:
    """Every reader and ``shardsafe verify``/``inspect`` refuse ``path`` with CheckpointNotFoundError
    naming every one of ``words`` and none of ``never``; returns the message."""
    message = ""
    for name, read in _readers(path).items():
        with pytest.raises(CheckpointNotFoundError) as info:
            read()
        message = str(info.value)
        for word in words:
            assert word in message, f"{name}: {word!r} not in {message!r}"
        for word in never:
            assert word not in message, f"{name}: {word!r} in {message!r}"
    for command in ("verify", "inspect"):
        err = io.StringIO()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("sys.stderr", err)
            assert main([command, str(path)]) == 1
        line = err.getvalue()
        assert line.startswith(f"shardsafe {command}: NOT A CHECKPOINT: ") and line.count("\n") == 1, line
        for word in words:
            assert word in line, (command, word, line)
    return message


UNCOMMITTED = "uncommitted"
MANAGER_REMOVES = "CheckpointManager removes"


def test_a_run_root(tmp_path: Path) -> None:
    for step in (100, 200, 300):
        shardsafe.save(tmp_path / "run" / f"step-{step}", {"w": torch.zeros(4, 4)}, metadata={"step": step})
    message = _refused(tmp_path / "run", "shardsafe ls", "step-300", never=(UNCOMMITTED,))
    assert str(tmp_path / "run" / "step-300") in message  # the newest, to load
    assert "3 checkpoint(s)" in message


def test_a_dcp_folder(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.zeros(4, 4)}, checkpoint_id=str(tmp_path / "dcp"))
    assert (tmp_path / "dcp" / ".metadata").is_file()
    _refused(tmp_path / "dcp", "DCP", "shardsafe import", "--allow-pickle", never=(UNCOMMITTED,))


@pytest.mark.parametrize("layout", ["single", "sharded", "safetensors+config"])
def test_a_hugging_face_folder(tmp_path: Path, layout: str) -> None:
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    if layout == "single":
        save_file({"w": torch.zeros(4, 4)}, str(hf / "model.safetensors"))
    elif layout == "sharded":
        save_file({"a": torch.zeros(2)}, str(hf / "model-00001-of-00002.safetensors"))
        save_file({"b": torch.zeros(2)}, str(hf / "model-00002-of-00002.safetensors"))
        index = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
        (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    else:
        save_file({"w": torch.zeros(4, 4)}, str(hf / "adapter_model.safetensors"))
        (hf / "config.json").write_text("{}")
    _refused(hf, "Hugging Face", "shardsafe import", "from_pretrained", never=(UNCOMMITTED,))


def _frozen_state() -> dict[str, Any]:
    return {"frozen": torch.ones(64, 64), "train": torch.zeros(64, 64), "step": 0}


def test_a_retired_incremental_base(tmp_path: Path) -> None:
    state = _frozen_state()
    with CheckpointManager(
        tmp_path, keep_last=1, incremental=True, full_save_every=2, leftover_age=0, save_on_signals=()
    ) as mgr:
        for s in range(1, 5):
            state["train"].add_(1.0)
            state["step"] = s
            mgr.save(s, state)
    retired, keeper = tmp_path / "step-00000003", tmp_path / "step-00000004"
    assert (retired / ".MANIFEST.json.deleting").is_file() and shardsafe.inspect(keeper).bases == [retired.name]
    message = _refused(retired, "retired", keeper.name, "not remove", never=(UNCOMMITTED, MANAGER_REMOVES))
    assert str(keeper) in message  # the one to load instead

    out = io.StringIO()  # `shardsafe ls` on the retired folder itself says the same
    assert ls_main(str(retired), verify=False, as_json=False, out=out) == 0
    assert "retired" in out.getvalue() and keeper.name in out.getvalue(), out.getvalue()


def test_an_interrupted_deletion(tmp_path: Path) -> None:
    path = tmp_path / "step-1"
    shardsafe.save(path, {"w": torch.zeros(4, 4)})
    os.rename(path / "MANIFEST.json", path / ".MANIFEST.json.deleting")  # a delete that died after its first step
    _refused(path, "deletion", "was interrupted", never=(UNCOMMITTED,))


def test_the_leftovers_of_an_uncommitted_save(tmp_path: Path) -> None:
    path = tmp_path / "step-1"
    shardsafe.save(path, {"w": torch.zeros(4, 4)})
    (path / "MANIFEST.json").unlink()
    _refused(path, UNCOMMITTED, "MANIFEST.json", MANAGER_REMOVES)


def test_an_unrelated_folder(tmp_path: Path) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("x")
    _refused(tmp_path / "notes", "no checkpoint", "todo.txt", never=(UNCOMMITTED,))


@pytest.mark.parametrize("what", ["nothing", "empty folder"])
def test_nothing_there(tmp_path: Path, what: str) -> None:
    path = tmp_path / "step-9"
    if what == "empty folder":
        path.mkdir()
    _refused(path, "no checkpoint", never=(UNCOMMITTED,))


def test_a_torch_save_file(tmp_path: Path) -> None:
    torch.save({"w": torch.zeros(2)}, tmp_path / "model.pt")
    _refused(tmp_path / "model.pt", "is a file", "shardsafe import")


@pytest.mark.parametrize("kind", ["dcp", "hf"])
def test_ls_names_a_folder_of_another_format(tmp_path: Path, kind: str) -> None:
    folder = tmp_path / kind
    if kind == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.save({"w": torch.zeros(4, 4)}, checkpoint_id=str(folder))
    else:
        from safetensors.torch import save_file

        folder.mkdir()
        save_file({"w": torch.zeros(4, 4)}, str(folder / "model.safetensors"))
    out = io.StringIO()
    assert ls_main(str(folder), verify=False, as_json=False, out=out) == 0
    text = out.getvalue()
    assert "shardsafe import" in text and ("DCP" in text if kind == "dcp" else "Hugging Face" in text), text
