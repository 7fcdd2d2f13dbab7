"""Side files (format v3): files of their own names committed with a checkpoint (``files=``,
``write_files=``), listed in its manifest with size and checksum, verified, shown, read back, deleted by
validated name, refused where they cannot be committed atomically; on a local disk and an object store;
two ranks giving one name; a crash while they are written."""

from __future__ import annotations

# ruff: noqa: F811  (the S3 fixtures are imported from conftest_s3 and named as test parameters)
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.catalog.delete import delete_checkpoint, remove_pending
from shardsafe.cli.main import _inspect
from shardsafe.format.manifest import parse_manifest, seal_manifest
from shardsafe.storage import get_storage

from harness import check_ok, run_ranks


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def _manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / "MANIFEST.json").read_text())


def test_files_and_write_files_are_committed_listed_verified_and_read_back(tmp_path: Path) -> None:
    def hook(folder: str) -> None:  # code that writes by path, as Accelerate's save-state hooks do
        with open(os.path.join(folder, "data.json"), "w") as f:
            json.dump({"class_name": "Linear"}, f)

    ckpt = tmp_path / "ckpt"
    state = b'{"global_step": 7}'
    shardsafe.save(ckpt, {"model": _model()}, files={"trainer_state.json": state}, write_files=hook)
    assert (ckpt / "trainer_state.json").read_bytes() == state  # where the Trainer reads it by path
    assert json.loads((ckpt / "data.json").read_text()) == {"class_name": "Linear"}
    doc = _manifest(ckpt)
    assert doc["format_version"] == 3
    assert doc["side_files"]["trainer_state.json"]["size"] == len(state)
    assert set(doc["side_files"]) == {"trainer_state.json", "data.json"}
    assert shardsafe.read_file(ckpt, "trainer_state.json") == state
    assert shardsafe.inspect(ckpt).side_files == {"data.json": 24, "trainer_state.json": len(state)}
    summary = shardsafe.verify(ckpt)
    assert summary.side_files == 2
    out = io.StringIO()
    assert _inspect(str(ckpt), as_json=False, out=out) == 0
    assert "trainer_state.json  side file" in out.getvalue()
    with pytest.raises(shardsafe.MissingKeysError, match=r"data\.json, trainer_state\.json"):
        shardsafe.read_file(ckpt, "optimizer.pt")
    loaded = shardsafe.load(ckpt, {"model": _model()})
    assert loaded == {}


def test_a_checkpoint_without_side_files_lists_none(tmp_path: Path) -> None:
    shardsafe.save(tmp_path / "c", {"model": _model()})
    doc = _manifest(tmp_path / "c")
    assert doc["format_version"] == 3 and doc["side_files"] == {}
    assert shardsafe.inspect(tmp_path / "c").side_files == {}


@pytest.mark.parametrize(
    "name",
    ["../x", "a/b", ".hidden", "", "MANIFEST.json", "manifest.JSON.tmp", "data-00000-1a.safetensors", "a..b", "x\n"],
)
def test_names_are_validated_at_the_call(tmp_path: Path, name: str) -> None:
    with pytest.raises(shardsafe.InvalidArgumentError, match="side file name"):
        shardsafe.save(tmp_path / "c", {"model": _model()}, files={name: b"1"})
    assert not (tmp_path / "c").exists() and os.listdir(tmp_path) == []


def test_write_files_leaving_a_folder_or_a_bad_name_fails_and_leaves_nothing(tmp_path: Path) -> None:
    def folder(d: str) -> None:
        open(os.path.join(d, "ok.json"), "w").close()
        os.mkdir(os.path.join(d, "sub"))

    def clash(d: str) -> None:
        open(os.path.join(d, "MANIFEST.json"), "w").close()

    for hook, match in ((folder, "'sub' is not a plain file"), (clash, "taken by the format")):
        with pytest.raises(shardsafe.InvalidArgumentError, match=match):
            shardsafe.save(tmp_path / "c", {"model": _model()}, write_files=hook)
        assert os.listdir(tmp_path) == []  # no checkpoint, no pending directory: ok.json went too
    with pytest.raises(shardsafe.InvalidTypeError, match="takes bytes"):
        shardsafe.save(tmp_path / "c", {"model": _model()}, files={"a.json": "text"})  # type: ignore[dict-item]


def test_overwrite_rules_and_deletion_by_validated_name(tmp_path: Path) -> None:
    ckpt = tmp_path / "c"
    shardsafe.save(ckpt, {"model": _model()}, files={"trainer_state.json": b"1"})
    before = _manifest(ckpt)["save_id"]
    with pytest.raises(shardsafe.CheckpointExistsError, match="carries side files"):
        shardsafe.save(ckpt, {"model": _model()}, files={"trainer_state.json": b"2"}, overwrite=True)
    assert _manifest(ckpt)["save_id"] == before and shardsafe.read_file(ckpt, "trainer_state.json") == b"1"
    # An overwrite without side files may replace it: the old side file goes after the commit.
    shardsafe.save(ckpt, {"model": _model()}, overwrite=True)
    assert sorted(n for n in os.listdir(ckpt) if not n.startswith("data-")) == ["MANIFEST.json"]
    # Deleting a checkpoint removes its side files through the tombstone's validated names.
    other = tmp_path / "d"
    shardsafe.save(other, {"model": _model()}, files={"notes.txt": b"x"})
    delete_checkpoint(get_storage(str(other)), str(other))
    assert not other.exists()
    # A user's file is not a side file unless a manifest lists it: a save there is refused.
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "notes.txt").write_text("mine")
    with pytest.raises(shardsafe.CheckpointExistsError, match="did not write"):
        shardsafe.save(tmp_path / "e", {"model": _model()})


def test_altered_missing_and_forged_side_files_are_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "c"
    shardsafe.save(ckpt, {"model": _model()}, files={"t.json": b'{"a": 1}'})
    (ckpt / "t.json").write_bytes(b'{"a": 2}')  # same size, other bytes
    for read in (shardsafe.verify, lambda p: shardsafe.read_file(p, "t.json")):
        with pytest.raises(shardsafe.CorruptCheckpointError, match=r"t\.json: side file fails its checksum"):
            read(ckpt)
    (ckpt / "t.json").unlink()
    with pytest.raises(shardsafe.CorruptCheckpointError, match="side file missing"):
        shardsafe.verify(ckpt)
    doc = _manifest(ckpt)
    raw = json.dumps(seal_manifest({**doc, "side_files": {"../escape": {"size": 1, "checksum": "0" * 16}}})).encode()
    with pytest.raises(shardsafe.CorruptCheckpointError, match="not a plain name"):
        parse_manifest(raw, "m")
    # Old readers refuse what they do not know: v2 with side_files, and v3 without them, are both refused.
    for version, body in ((2, doc), (3, {k: v for k, v in doc.items() if k != "side_files"})):
        raw = json.dumps(seal_manifest({**body, "format_version": version})).encode()
        with pytest.raises(shardsafe.CorruptCheckpointError, match="side_files"):
            parse_manifest(raw, "m")


def _two_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model = _model()
    same = {"trainer_state.json": b"same"}  # given on both ranks, the same bytes
    shardsafe.save(f"{root}/ok", {"model": model}, files=same, timeout=60)
    out["ok"] = shardsafe.read_file(f"{root}/ok", "trainer_state.json")
    for case, files in (("differ", {"a.json": bytes([rank])}), ("only1", {} if rank == 0 else {"b.json": b"1"})):
        try:
            shardsafe.save(f"{root}/{case}", {"model": model}, files=files, timeout=60)
            out[case] = "committed"
        except shardsafe.CheckpointError as err:  # the same class on every rank (rank 1: as rank 0's error)
            out[case] = f"{isinstance(err, shardsafe.InvalidArgumentError)}: {err}"
    return out


def test_two_ranks_giving_one_name_need_the_same_bytes(tmp_path: Path) -> None:
    r0, r1 = check_ok(run_ranks(_two_ranks, 2, str(tmp_path), timeout=120))
    assert r0["ok"] == r1["ok"] == b"same"
    for r in (r0, r1):
        assert r["differ"].startswith("True") and "other bytes for the side file 'a.json'" in r["differ"]
        assert r["only1"].startswith("True") and "rank 1 gave the side file 'b.json' and rank 0 did not" in r["only1"]
    assert sorted(os.listdir(tmp_path)) == ["ok"]  # nothing of the refused saves is left, side files included


_CRASH = """
import sys, torch, shardsafe
torch.manual_seed(0)
shardsafe.save(sys.argv[1], {"model": torch.nn.Linear(3, 2)}, files={"a.json": b"1", "b.json": b"2"})
"""


def test_a_crash_while_writing_side_files_commits_nothing_and_cleanup_knows_what_was_staged(tmp_path: Path) -> None:
    """Two saves killed (``os._exit``) in fresh processes, side by side: one after its first side file (before
    its manifest was staged), one after staging its manifest (before the publish)."""
    points = {"during": "save.side_files", "staged": "save.publish"}
    procs = {
        key: subprocess.Popen(
            [sys.executable, "-c", _CRASH, str(tmp_path / key)],
            env={**os.environ, "SHARDSAFE_FAULT": f"{point}:rank=0:exit=9"},
            stderr=subprocess.PIPE,
        )
        for key, point in points.items()
    }
    for proc in procs.values():
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 9, err.decode()[-2000:]
    storage = get_storage(str(tmp_path))
    pending = {key: str(tmp_path / n) for key in points for n in os.listdir(tmp_path) if n.startswith(f".{key}.")}
    for key in points:  # nothing committed: no folder at the target, a load says so
        assert not (tmp_path / key).exists()
        with pytest.raises(shardsafe.CheckpointNotFoundError):
            shardsafe.load(tmp_path / key)
    assert {"a.json", "b.json", "MANIFEST.json"} <= set(os.listdir(pending["staged"]))
    assert remove_pending(storage, pending["staged"])  # the staged manifest names its side files
    assert "a.json" in os.listdir(pending["during"]) and "b.json" not in os.listdir(pending["during"])
    # Before its manifest was staged nothing says a.json is the save's own: cleanup leaves it (logged).
    assert not remove_pending(storage, pending["during"])
    assert os.listdir(pending["during"]) == ["a.json"]
    shardsafe.save(tmp_path / "during", {"model": _model()}, files={"a.json": b"3"})  # the path takes a new save
    assert shardsafe.read_file(tmp_path / "during", "a.json") == b"3"


def test_an_injected_failure_while_writing_side_files_removes_them(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("SHARDSAFE_FAULT", "save.side_files:rank=0:raise")
    with pytest.raises(shardsafe.CheckpointError, match="injected fault"):
        shardsafe.save(tmp_path / "c", {"model": _model()}, files={"a.json": b"1"})
    assert os.listdir(tmp_path) == []


@pytest.mark.timeout(120)
def test_side_files_on_an_object_store(s3_server: Any, s3_bucket: str) -> None:
    opts = s3_server.storage_options
    url = f"s3://{s3_bucket}/run/c"

    def hook(folder: str) -> None:
        with open(os.path.join(folder, "data.json"), "wb") as f:
            f.write(b"{}")

    files = {"trainer_state.json": b"s3"}
    shardsafe.save(url, {"model": _model()}, files=files, write_files=hook, storage_options=opts)
    assert shardsafe.read_file(url, "trainer_state.json", storage_options=opts) == b"s3"
    assert shardsafe.verify(url, storage_options=opts).side_files == 2
    assert shardsafe.inspect(url, storage_options=opts).side_files == {"data.json": 2, "trainer_state.json": 2}
    with pytest.raises(shardsafe.CheckpointExistsError, match="carries side files"):
        shardsafe.save(url, {"model": _model()}, files={"x.json": b"1"}, overwrite=True, storage_options=opts)
    storage = get_storage(url, opts)
    delete_checkpoint(storage, url)
    assert storage.list_dir(url) == []


from conftest_s3 import s3_bucket, s3_server  # noqa: E402, F401
