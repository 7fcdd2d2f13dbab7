"""Nothing is deleted through a symbolic link, ever, and one grammar of names serves the save's target
check, the sweep, the delete gate and the listing.

- A save target that is a symbolic link is refused, whatever ``overwrite=`` says: ``run/latest ->
  step-100`` saved over with ``overwrite=True`` used to replace step-100 and delete its data file.
- ``base=`` a symbolic link to a sibling records the sibling's real name (a reference by the link's
  name was invisible to the delete rule: overwriting the real base deleted the files the new
  checkpoint reads); a link that leads out of the folder is refused. References recorded by a link's
  name (older checkpoints) still count when the real checkpoint is overwritten.
- Only regular files go: the sweep leaves FIFOs and sockets named like data files, and the delete
  gate refuses to delete inside a folder that is a link.
- Names are ASCII: a name with other Unicode digits is no data file; a target holding one, or a
  folder, a link or a FIFO under one of shardsafe's names, is refused untouched.
- A pending directory with a spec-valid save id holding dots (``.ck.staging-a.b``) is listed by
  ``shardsafe ls`` and the manager, and removed by the manager's cleanup and by a save's sweep once
  abandoned.
- What an export left (its hidden folder, a replaced export set aside) is listed by ``shardsafe ls``
  as incomplete, with what it is, and the manager's cleanup leaves it (it is not a save's).
"""

from __future__ import annotations

import io
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.catalog.delete import delete_checkpoint
from shardsafe.catalog.names import DATA_FILE, data_file, is_own
from shardsafe.catalog.unlink import remove as delete_files
from shardsafe.cli.ls import ls_main
from shardsafe.engine import commit
from shardsafe.manager.cleanup import remove_leftovers
from shardsafe.manager.listing import scan
from shardsafe.storage.local import LocalStorage

HOUR = 3600.0


def _state(value: float) -> dict[str, Any]:
    return {"w": torch.full((64,), value), "b": torch.full((8,), -value), "step": int(value)}


def _snapshot(root: Path) -> dict[str, Any]:
    """Every entry under ``root`` (links not followed) with its kind and bytes."""
    out: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            p = Path(dirpath, name)
            rel = os.path.relpath(p, root)
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir",)
            elif p.is_file():
                out[rel] = ("file", p.read_bytes())
            else:
                out[rel] = ("other",)
    return out


@pytest.fixture(params=["local", "file"])
def prefix(request: Any, tmp_path: Path) -> Iterator[str]:
    yield str(tmp_path) if request.param == "local" else f"file://{tmp_path}"


@pytest.mark.parametrize("overwrite", [True, False])
def test_a_save_target_that_is_a_link_is_refused_untouched(tmp_path: Path, prefix: str, overwrite: bool) -> None:
    shardsafe.save(f"{prefix}/run/step-100", _state(1.0))
    (tmp_path / "run" / "latest").symlink_to("step-100")
    before = _snapshot(tmp_path)
    with pytest.raises(shardsafe.CheckpointExistsError, match="symbolic link"):
        shardsafe.save(f"{prefix}/run/latest", _state(2.0), overwrite=overwrite)
    assert _snapshot(tmp_path) == before
    assert shardsafe.load(str(tmp_path / "run" / "step-100"))["step"] == 1


def test_a_dangling_link_target_is_refused(tmp_path: Path) -> None:
    (tmp_path / "latest").symlink_to("nowhere")
    with pytest.raises(shardsafe.CheckpointExistsError, match="symbolic link"):
        shardsafe.save(str(tmp_path / "latest"), _state(1.0))
    assert not (tmp_path / "nowhere").exists() and (tmp_path / "latest").is_symlink()


def test_a_base_given_as_a_link_is_recorded_by_its_real_name(tmp_path: Path, prefix: str) -> None:
    run = tmp_path / "run"
    shardsafe.save(f"{prefix}/run/b", _state(1.0))
    (run / "latest").symlink_to("b")
    shardsafe.save(f"{prefix}/run/c", _state(1.0), base=f"{prefix}/run/latest")
    refs = json.loads((run / "c" / "MANIFEST.json").read_bytes())["refs"]
    assert list(refs) == ["b"], refs
    shardsafe.save(f"{prefix}/run/b", _state(5.0), overwrite=True)  # keeps the files c reads
    shardsafe.verify(str(run / "c"))
    assert torch.equal(shardsafe.load(str(run / "c"))["w"], torch.full((64,), 1.0))


def test_a_base_link_leading_out_of_the_folder_is_refused(tmp_path: Path) -> None:
    shardsafe.save(str(tmp_path / "elsewhere" / "b"), _state(1.0))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "latest").symlink_to(tmp_path / "elsewhere" / "b")
    with pytest.raises(shardsafe.CheckpointError, match=r"not a sibling|symbolic link"):
        shardsafe.save(str(tmp_path / "run" / "c"), _state(1.0), base=str(tmp_path / "run" / "latest"))
    assert not (tmp_path / "run" / "c").exists()


def test_a_reference_recorded_by_a_links_name_still_keeps_the_files(tmp_path: Path) -> None:
    """A checkpoint written before bases were resolved refers to ``latest``, a link to ``b``: deleting
    and overwriting ``b`` keeps the files ``c`` reads through the link."""
    run = tmp_path / "run"
    shardsafe.save(str(run / "b"), _state(1.0))
    shardsafe.save(str(run / "c"), _state(1.0), base=str(run / "b"))
    (run / "latest").symlink_to("b")
    doc = json.loads((run / "c" / "MANIFEST.json").read_bytes())
    doc["refs"] = {"latest": doc["refs"]["b"]}
    for entry in doc["tensors"].values():
        for chunk in entry.get("chunks", []):
            if chunk.get("ref") == "b":
                chunk["ref"] = "latest"
    from shardsafe.format.manifest import seal_manifest

    (run / "c" / "MANIFEST.json").write_bytes(json.dumps(seal_manifest(doc)).encode())
    shardsafe.verify(str(run / "c"))
    shardsafe.save(str(run / "b"), _state(5.0), overwrite=True)
    shardsafe.verify(str(run / "c"))
    assert torch.equal(shardsafe.load(str(run / "c"))["w"], torch.full((64,), 1.0))


def _during_commit(monkeypatch: pytest.MonkeyPatch, make: Any) -> None:
    real = commit.fault_point

    def hook(point: str, rank: int | None = None) -> None:
        if point == "save.commit":
            make()
        real(point, rank)

    monkeypatch.setattr(commit, "fault_point", hook)


def _old(path: Path) -> None:
    then = time.time() - 3 * HOUR
    os.utime(path, (then, then), follow_symlinks=False)


def _sid(age: float) -> str:
    return f"{int(time.time() - age)}ab12cd34ef"


def test_the_sweep_leaves_fifos_and_sockets_named_like_data_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ck"
    shardsafe.save(str(path), _state(1.0))
    fifo, sock = path / data_file(0, _sid(3 * HOUR)), path / data_file(1, _sid(3 * HOUR))
    server = socket.socket(socket.AF_UNIX)
    orphan = path / data_file(0, _sid(2 * HOUR))

    def make() -> None:
        os.mkfifo(fifo)
        _old(fifo)
        here = os.getcwd()
        os.chdir(path)  # a socket's path is short: bound by its name in its folder
        try:
            server.bind(sock.name)
        finally:
            os.chdir(here)
        _old(sock)
        orphan.write_bytes(b"an orphan")
        _old(orphan)

    _during_commit(monkeypatch, make)
    try:
        shardsafe.save(str(path), _state(2.0), overwrite=True)
    finally:
        server.close()
    assert fifo.exists() and sock.exists() and not orphan.exists()
    assert shardsafe.load(str(path))["step"] == 2


def test_the_delete_gate_keeps_what_is_not_a_regular_file_and_never_works_through_a_link(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    folder.mkdir()
    fifo = folder / data_file(0, "abc")
    os.mkfifo(fifo)
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / data_file(1, "abc")
    victim.write_bytes(b"precious")
    (tmp_path / "link").symlink_to(outside)
    assert delete_files(LocalStorage(), str(folder), [fifo.name]) == [fifo.name]
    assert fifo.exists()
    with pytest.raises(ValueError, match="symbolic link"):
        delete_files(LocalStorage(), str(tmp_path / "link"), [victim.name])
    assert victim.read_bytes() == b"precious"
    with pytest.raises(ValueError, match="symbolic link"):
        delete_checkpoint(LocalStorage(), str(tmp_path / "link"))


def test_names_are_ascii() -> None:
    arabic = "data-" + "\u0660" * 5 + "-ab.safetensors"
    assert DATA_FILE.match(arabic) is None and not is_own(arabic)
    assert is_own(data_file(0, "ab"))


@pytest.mark.parametrize("kind", ["unicode-digits", "folder", "link", "fifo", "manifest-link", "manifest-folder"])
def test_a_target_holding_what_shardsafe_does_not_write_is_refused_untouched(
    tmp_path: Path, prefix: str, kind: str
) -> None:
    path = tmp_path / "ck"
    shardsafe.save(f"{prefix}/ck", _state(1.0))
    own = next(path.glob("data-*")).name
    (tmp_path / "outside.bin").write_bytes(b"not shardsafe's")
    sid = _sid(3 * HOUR)
    if kind == "unicode-digits":
        (path / ("data-" + "\u0660" * 5 + f"-{sid}.safetensors")).write_bytes(b"mine")
    elif kind == "folder":
        (path / data_file(0, sid)).mkdir()
    elif kind == "link":
        (path / data_file(0, sid)).symlink_to(tmp_path / "outside.bin")
    elif kind == "fifo":
        os.mkfifo(path / data_file(0, sid))
    else:
        (path / "MANIFEST.json").rename(tmp_path / "real-manifest.json")
        if kind == "manifest-link":
            (path / "MANIFEST.json").symlink_to(tmp_path / "real-manifest.json")
        else:
            (path / "MANIFEST.json").mkdir()
    for p in path.iterdir():
        _old(p)
    before = _snapshot(tmp_path)
    with pytest.raises(shardsafe.CheckpointExistsError, match="did not write"):
        shardsafe.save(f"{prefix}/ck", _state(2.0), overwrite=True)
    assert _snapshot(tmp_path) == before
    assert (path / own).exists()


DOTTED = ".ck.staging-a.b"


def _abandoned_pending(root: Path) -> Path:
    """A pending directory of save ``a.b`` (a spec-valid save id) of ``root/ck``, abandoned long ago."""
    pending = root / DOTTED
    pending.mkdir(parents=True)
    for name in (data_file(0, "a.b"), "MANIFEST.json"):
        (pending / name).write_bytes(b"x")
        _old(pending / name)
    _old(pending)
    return pending


def test_shardsafe_ls_and_the_manager_list_a_pending_directory_with_a_dotted_save_id(tmp_path: Path) -> None:
    shardsafe.save(str(tmp_path / "ck"), _state(1.0))
    _abandoned_pending(tmp_path)
    out = io.StringIO()
    assert ls_main(str(tmp_path), verify=False, as_json=True, out=out) == 0
    listed = {c["name"]: c["status"] for c in json.loads(out.getvalue())["checkpoints"]}
    assert listed == {"ck": "committed", DOTTED: "incomplete"}, listed
    assert DOTTED in [r.name for r in scan(LocalStorage(), str(tmp_path))]


def test_the_manager_cleanup_removes_an_abandoned_pending_directory_with_a_dotted_save_id(tmp_path: Path) -> None:
    shardsafe.save(str(tmp_path / "ck"), _state(1.0))
    pending = _abandoned_pending(tmp_path)
    removed = remove_leftovers(LocalStorage(), LocalStorage(), scan(LocalStorage(), str(tmp_path)), min_age=HOUR)
    assert removed == [str(pending)] and not pending.exists()


def test_a_saves_sweep_removes_an_abandoned_pending_directory_with_a_dotted_save_id(tmp_path: Path) -> None:
    shardsafe.save(str(tmp_path / "ck"), _state(1.0))
    pending = _abandoned_pending(tmp_path)
    shardsafe.save(str(tmp_path / "ck"), _state(2.0), overwrite=True)
    assert not pending.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_what_an_export_left_is_listed_and_the_cleanup_leaves_it(tmp_path: Path) -> None:
    shardsafe.save(str(tmp_path / "ck"), _state(1.0))
    hidden, aside = tmp_path / ".out.export-0123456789ab", tmp_path / ".out.replaced-ba9876543210"
    for folder in (hidden, aside):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x")
        _old(folder / "model.safetensors")
        _old(folder)
    out = io.StringIO()
    assert ls_main(str(tmp_path), verify=False, as_json=True, out=out) == 0
    listed = {c["name"]: (c["status"], c["reason"]) for c in json.loads(out.getvalue())["checkpoints"]}
    assert set(listed) == {"ck", hidden.name, aside.name}, listed
    assert listed[hidden.name][0] == listed[aside.name][0] == "incomplete"
    assert "export to 'out'" in listed[hidden.name][1] and "replaced" in listed[aside.name][1]
    removed = remove_leftovers(LocalStorage(), LocalStorage(), scan(LocalStorage(), str(tmp_path)), min_age=HOUR)
    assert removed == [] and (hidden / "model.safetensors").exists() and (aside / "model.safetensors").exists()


def test_the_delete_rule_never_follows_a_link_nor_removes_recursively(tmp_path: Path) -> None:
    """Deleting a checkpoint whose listed data files were swapped for a link (to a file outside), a
    folder (holding a file) and a FIFO removes the rest and leaves those three, and what they hold or
    point to, in place; the checkpoint's folder stays, not empty."""
    path = tmp_path / "ck"
    shardsafe.save(str(path), {f"t{i}": torch.full((4,), float(i)) for i in range(3)})
    listed = sorted(p.name for p in path.glob("data-*"))
    assert len(listed) == 1
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"precious")
    doc = json.loads((path / "MANIFEST.json").read_bytes())
    entry = doc["files"][listed[0]]
    names = [data_file(r, "ab12") for r in range(3)]
    for name in names:
        doc["files"][name] = entry
    from shardsafe.format.manifest import seal_manifest

    (path / "MANIFEST.json").write_bytes(json.dumps(seal_manifest(doc)).encode())
    (path / names[0]).symlink_to(outside)
    (path / names[1]).mkdir()
    (path / names[1] / "inside.txt").write_text("kept")
    os.mkfifo(path / names[2])
    delete_checkpoint(LocalStorage(), str(path))
    assert outside.read_bytes() == b"precious" and (path / names[0]).is_symlink()
    assert (path / names[1] / "inside.txt").read_text() == "kept"
    assert (path / names[2]).exists() and not (path / listed[0]).exists()
    assert not (path / "MANIFEST.json").exists()


def test_a_fifo_named_like_a_pending_directory_stays_and_does_not_stop_the_sweep(tmp_path: Path) -> None:
    """Found by tests/fuzz_sweep.py: the sweep took a FIFO named ``.ck.staging-<id>`` for an abandoned
    pending directory, its removal failed (not a directory), and the orphans of the checkpoint stayed."""
    path = tmp_path / "ck"
    shardsafe.save(str(path), _state(1.0))
    fifo = tmp_path / f".ck.staging-{_sid(3 * HOUR)}"
    os.mkfifo(fifo)
    _old(fifo)
    orphan = path / data_file(0, _sid(2 * HOUR))
    orphan.write_bytes(b"an orphan")
    _old(orphan)
    shardsafe.save(str(path), _state(2.0), overwrite=True)
    assert fifo.exists() and not orphan.exists()


def test_a_saves_sweep_removes_an_abandoned_pending_directory_of_a_sibling(tmp_path: Path) -> None:
    """A save killed on its way to ``ck`` leaves ``.ck.staging-<id>``; the job's next saves go to other
    paths (the next steps), so the pending directory must go with their sweeps, not wait for a save to
    ``ck`` that never comes. A sibling's pending directory not yet abandoned stays."""
    pending = _abandoned_pending(tmp_path)
    young = tmp_path / ".other.staging-ab12"
    young.mkdir()
    (young / data_file(0, "ab12")).write_bytes(b"x")
    shardsafe.save(str(tmp_path / "next"), _state(1.0))
    assert not pending.exists()
    assert young.exists() and (young / data_file(0, "ab12")).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.staging-ab12", "next"]
