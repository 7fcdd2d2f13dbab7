"""The data files an overwrite keeps for incremental checkpoints (format v2) go with their last
referrer (catalog/delete.py, docs/incremental.md "Moving, deleting and overwriting"): an overwrite of
a base keeps its old files while a sibling refers to them; deleting the last such sibling removes
them, and nothing else: hostile referrers, saves in flight, other referrers and crashes at every
step of the delete leave every committed checkpoint loadable."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.catalog.delete import delete_checkpoint, finish_deletion
from shardsafe.catalog.names import TOMBSTONE
from shardsafe.format.manifest import seal_manifest
from shardsafe.manager.cleanup import remove_leftovers
from shardsafe.manager.listing import scan
from shardsafe.storage.base import Storage
from shardsafe.storage.local import LocalStorage

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


def names(st: Storage, path: str) -> list[str]:
    return st.list_dir(path)


def data(st: Storage, path: str) -> list[str]:
    return [n for n in st.list_dir(path) if n.startswith("data-")]


def storage_for(root: str) -> Storage:
    if root.startswith("memory://"):
        from shardsafe.storage.remote import FsspecStorage

        return FsspecStorage.for_path(root)
    return LocalStorage()


@pytest.fixture(params=["local", "memory"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "memory":
        return f"memory://release-{uuid.uuid4().hex[:8]}/run"
    return str(tmp_path)


def overwritten_base(
    root: str, *, second: bool = False, new_state: dict[str, Any] = OTHER
) -> tuple[list[str], list[str]]:
    """b full, c incremental on b (and d on c, which refers to b's files directly: one hop), then b
    overwritten with ``new_state``: (b's old data files, b's new ones)."""
    st = storage_for(root)
    shardsafe.save(f"{root}/b", state_at(1))
    old = data(st, f"{root}/b")
    shardsafe.save(f"{root}/c", state_at(2), base=f"{root}/b")
    if second:
        shardsafe.save(f"{root}/d", state_at(3), base=f"{root}/c")
        assert shardsafe.inspect(f"{root}/d").bases == ["b"]
    shardsafe.save(f"{root}/b", new_state, overwrite=True)
    new = [n for n in data(st, f"{root}/b") if n not in old]
    assert new and set(old) <= set(data(st, f"{root}/b"))  # kept for c, beside b's new files
    holds(f"{root}/c", state_at(2))
    return old, new


def test_deleting_the_last_referrer_removes_the_files_an_overwrite_kept(root: str) -> None:
    st = storage_for(root)
    _, new = overwritten_base(root)
    delete_checkpoint(st, f"{root}/c")
    assert names(st, root) == ["b"]
    assert names(st, f"{root}/b") == sorted([*new, "MANIFEST.json"])  # b's old files went with c
    holds(f"{root}/b", OTHER)


def test_a_second_referrer_keeps_the_old_files_until_it_is_deleted_too(root: str) -> None:
    st = storage_for(root)
    old, new = overwritten_base(root, second=True)
    delete_checkpoint(st, f"{root}/c")
    assert set(old) <= set(data(st, f"{root}/b"))  # d refers to them
    holds(f"{root}/d", state_at(3))
    holds(f"{root}/b", OTHER)
    delete_checkpoint(st, f"{root}/d")
    assert names(st, root) == ["b"] and data(st, f"{root}/b") == new
    holds(f"{root}/b", OTHER)


@pytest.mark.parametrize("referred", [False, True], ids=["unreferenced", "new-save-referenced"])
def test_an_overwritten_then_deleted_base_stays_retired_until_its_old_files_are_free(
    tmp_path: Path, referred: bool
) -> None:
    """b overwritten, then deleted (its new files kept too when e refers to them): its folder keeps
    its tombstone (listed as retired) while c refers to its old files; deleting the referrers
    removes the whole folder."""
    st, root = LocalStorage(), str(tmp_path)
    old, new = overwritten_base(root)
    if referred:
        shardsafe.save(tmp_path / "e", OTHER, base=tmp_path / "b")
        assert shardsafe.inspect(tmp_path / "e").bases == ["b"]
    delete_checkpoint(st, f"{root}/b")
    assert TOMBSTONE in names(st, f"{root}/b") and set(old) <= set(data(st, f"{root}/b"))
    assert {r.name: r.status for r in scan(st, root)}["b"] == "retired"
    holds(f"{root}/c", state_at(2))
    delete_checkpoint(st, f"{root}/c")
    if referred:
        assert names(st, f"{root}/b") == sorted([*new, TOMBSTONE])  # e still refers to the new files
        holds(f"{root}/e", OTHER)
        delete_checkpoint(st, f"{root}/e")
    assert names(st, root) == []


# -- hostile referrers: a manifest's refs table decides what may go only within the rules ------------


def retarget(path: Path, old: str, new: str) -> None:
    """Rewrite the manifest of ``path`` replacing ``old`` by ``new`` everywhere (a save id or a
    sibling's name in the refs table and the chunks), re-sealed as a hostile author would."""
    doc = json.loads((path / "MANIFEST.json").read_text().replace(old, new))
    (path / "MANIFEST.json").write_text(json.dumps(seal_manifest(doc)))


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def sid_of(path: Path) -> str:
    sid: str = json.loads((path / "MANIFEST.json").read_text())["save_id"]
    return sid


def without_c(before: dict[str, bytes]) -> dict[str, bytes]:
    return {k: v for k, v in before.items() if not k.startswith("c/")}


def test_a_referrer_naming_the_current_save_of_its_sibling_deletes_none_of_it(tmp_path: Path) -> None:
    """c's refs table names b's current save and files (of the very sizes recorded: b was overwritten
    with a state of the same shapes), as if they were the replaced ones."""
    old, new = overwritten_base(str(tmp_path), new_state=state_at(9))
    assert [(tmp_path / "b" / n).stat().st_size for n in old] == [(tmp_path / "b" / n).stat().st_size for n in new]
    retarget(tmp_path / "c", old[0].split("-")[2].split(".")[0], sid_of(tmp_path / "b"))
    before = snapshot(tmp_path)
    delete_checkpoint(LocalStorage(), str(tmp_path / "c"))
    assert snapshot(tmp_path) == without_c(before)
    holds(tmp_path / "b", state_at(9))


@pytest.mark.parametrize("case", ["other-folder", "corrupt-sibling", "other-size", "in-flight", "self"])
def test_a_hostile_referrer_deletes_nothing_outside_the_rule(tmp_path: Path, case: str) -> None:
    """c's refs table names: a folder that is no checkpoint holding a file of the named save id; a
    sibling whose manifest does not validate (beside a valid tombstone); a file of another size than
    the one recorded; the save id of a save in flight into the sibling (its staging directory still
    there); c itself."""
    old, _ = overwritten_base(str(tmp_path))
    old_sid = old[0].split("-")[2].split(".")[0]
    c_sid = sid_of(tmp_path / "c")
    if case == "other-folder":
        (tmp_path / "user").mkdir()
        shutil.copy(tmp_path / "b" / old[0], tmp_path / "user" / old[0])
        retarget(tmp_path / "c", '"b"', '"user"')
    elif case == "corrupt-sibling":  # beside a tombstone that validates (an interrupted delete)
        shutil.copy(tmp_path / "b" / "MANIFEST.json", tmp_path / "b" / TOMBSTONE)
        (tmp_path / "b" / "MANIFEST.json").write_text("{}")
    elif case == "other-size":
        doc = json.loads((tmp_path / "c" / "MANIFEST.json").read_text())
        doc["refs"]["b"]["files"][old[0]]["size"] += 8
        (tmp_path / "c" / "MANIFEST.json").write_text(json.dumps(seal_manifest(doc)))
    elif case == "in-flight":
        (tmp_path / f".b.staging-{old_sid}").mkdir()
    elif case == "self":  # c refers to "c", save id of files left in c's own folder
        (tmp_path / "c" / f"data-00003-{old_sid}.safetensors").write_bytes((tmp_path / "b" / old[0]).read_bytes())
        retarget(tmp_path / "c", old[0], f"data-00003-{old_sid}.safetensors")
        retarget(tmp_path / "c", '"b"', '"c"')
        (tmp_path / "c" / f"data-00000-{c_sid}.safetensors").unlink()  # nothing else holds c there
    before = snapshot(tmp_path)
    delete_checkpoint(LocalStorage(), str(tmp_path / "c"))
    kept = without_c(before)
    if case == "self":  # c's own folder: its files go, the one it named stays (not its own save's)
        kept[f"c/data-00003-{old_sid}.safetensors"] = before[f"c/data-00003-{old_sid}.safetensors"]
    assert snapshot(tmp_path) == kept
    if case != "corrupt-sibling":
        holds(tmp_path / "b", OTHER)


@pytest.mark.parametrize("ref", ["..", "../b", "/tmp", "a/b", ".b", ""])
def test_a_referrer_with_a_reference_outside_its_parent_deletes_nothing(tmp_path: Path, ref: str) -> None:
    overwritten_base(str(tmp_path))
    retarget(tmp_path / "c", '"b"', json.dumps(ref))
    before = snapshot(tmp_path)
    with pytest.raises(shardsafe.CorruptCheckpointError):
        delete_checkpoint(LocalStorage(), str(tmp_path / "c"))
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("where", ["staged", "retired"])
def test_a_save_in_flight_or_a_retired_referrer_keeps_the_old_files(tmp_path: Path, where: str) -> None:
    """Another referrer to b's old files: the staged manifest of a save in flight, or the tombstone
    of a retired checkpoint; the files go once it is gone (aborted, or its deletion finished)."""
    old, new = overwritten_base(str(tmp_path))
    other = tmp_path / (".x.staging-abc" if where == "staged" else "r")
    other.mkdir()
    copy = other / ("MANIFEST.json" if where == "staged" else TOMBSTONE)
    shutil.copy(tmp_path / "c" / "MANIFEST.json", copy)
    st = LocalStorage()
    delete_checkpoint(st, str(tmp_path / "c"))
    assert set(old) <= set(data(st, str(tmp_path / "b")))
    holds(tmp_path / "b", OTHER)
    if where == "retired":
        finish_deletion(st, str(other))  # its own files are gone: its deletion completes
        assert not other.exists() and data(st, str(tmp_path / "b")) == new
    else:  # the save in flight aborted: the manager's sweep of unlisted files in b reclaims them
        copy.unlink()
        other.rmdir()
        remove_leftovers(st, st, scan(st, str(tmp_path)), min_age=0)
        assert data(st, str(tmp_path / "b")) == new


# -- crashes: a kill before any step of the delete leaves every committed checkpoint loadable, and
# -- finishing the delete (what cleanup does, in either order) removes exactly the old files --------


class Killed(BaseException):
    """The process died here (nothing after it runs; what is on disk stays)."""


class Dying(LocalStorage):
    """Dies before its ``at``-th delete primitive (counting from 0)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.calls = at, 0

    def _tick(self) -> None:
        if self.calls == self.at:
            raise Killed
        self.calls += 1

    def retire_manifest(self, path: str, tombstone: str) -> None:
        self._tick()
        super().retire_manifest(path, tombstone)

    def unlink_names(self, directory: str, names: list[str]) -> None:
        self._tick()
        super().unlink_names(directory, names)

    def sync_dir(self, directory: str) -> None:
        self._tick()
        super().sync_dir(directory)

    def remove_dir_if_empty(self, path: str) -> bool:
        self._tick()
        return super().remove_dir_if_empty(path)


def crash_template(root: Path, retired: bool) -> list[str]:
    """b overwritten while c refers to it; then either d refers to b's new files (b committed), or
    b is deleted (retired: c refers to its old files). Returns b's new data files."""
    _, new = overwritten_base(str(root), new_state=state_at(9))
    if retired:
        delete_checkpoint(LocalStorage(), str(root / "b"))
    else:
        shardsafe.save(root / "d", state_at(10), base=root / "b")
    return new


def committed_hold(root: Path) -> list[str]:
    expect = {"b": state_at(9), "c": state_at(2), "d": state_at(10)}
    found = [r.name for r in scan(LocalStorage(), str(root)) if r.status == "committed"]
    for name in found:
        holds(root / name, expect[name])
    return found


@pytest.mark.parametrize("retired", [False, True], ids=["base-committed", "base-retired"])
def test_a_crash_at_any_step_of_the_delete_loses_nothing_and_is_finished_later(tmp_path: Path, retired: bool) -> None:
    template = tmp_path / "template"
    new = crash_template(template, retired)
    clean = Dying(at=-1)
    shutil.copytree(template, tmp_path / "clean")
    delete_checkpoint(clean, str(tmp_path / "clean" / "c"))
    for at in range(clean.calls):
        for order in (["b", "c"], ["c", "b"]):
            root = tmp_path / f"crash{at}{order[0]}"
            shutil.copytree(template, root)
            with pytest.raises(Killed):
                delete_checkpoint(Dying(at), str(root / "c"))
            assert set(committed_hold(root)) >= (set() if retired else {"b", "d"}), at
            st = LocalStorage()
            if (root / "c" / "MANIFEST.json").exists():
                delete_checkpoint(st, str(root / "c"))  # died before the manifest went: delete again
            for name in order:  # what cleanup does with a tombstone it finds, in either order
                finish_deletion(st, str(root / name))
            committed_hold(root)
            for name in os.listdir(root):  # died after a folder's last file went, before the folder
                if not os.listdir(root / name):
                    (root / name).rmdir()
            if retired:
                assert sorted(os.listdir(root)) == [], (at, order)
            else:
                assert sorted(os.listdir(root)) == ["b", "d"], (at, order)
                assert data(st, str(root / "b")) == new, (at, order)


KILL = """
import os, signal, sys
from shardsafe.catalog.delete import delete_checkpoint
from shardsafe.storage.local import LocalStorage

class Dies(LocalStorage):
    def unlink_names(self, directory, names):
        if os.path.basename(directory) == "b":  # the release of b's old files: killed right there
            os.kill(os.getpid(), signal.SIGKILL)
        super().unlink_names(directory, names)

delete_checkpoint(Dies(), sys.argv[1])
"""


def test_a_process_killed_while_releasing_the_old_files_leaves_them_to_the_tombstone(tmp_path: Path) -> None:
    new = crash_template(tmp_path, retired=False)
    env = {**os.environ, "PYTHONPATH": str(Path(shardsafe.__file__).parents[1])}
    done = subprocess.run([sys.executable, "-c", KILL, str(tmp_path / "c")], env=env, timeout=120, check=False)
    assert done.returncode == -signal.SIGKILL
    assert sorted(os.listdir(tmp_path / "c")) == [TOMBSTONE]  # uncommitted, its own files gone
    assert committed_hold(tmp_path) == ["b", "d"]
    finish_deletion(LocalStorage(), str(tmp_path / "c"))  # what cleanup does with the tombstone it finds
    assert sorted(os.listdir(tmp_path)) == ["b", "d"] and data(LocalStorage(), str(tmp_path / "b")) == new
    committed_hold(tmp_path)


# -- the last referrer replaced by an overwrite: its old manifest was the record -----------------------


@pytest.mark.parametrize("base", ["overwritten", "retired", "still-referred"])
def test_overwriting_the_last_referrer_releases_what_its_old_save_kept(root: str, base: str) -> None:
    """c, the only referrer of b's old files (b overwritten) or of the retired b, is overwritten by a
    full save: what only the old c needed goes. Overwritten by an incremental save that refers to
    them again (through d, one hop), c keeps them."""
    st = storage_for(root)
    old, new = overwritten_base(root, second=base == "still-referred")
    if base == "retired":
        delete_checkpoint(st, f"{root}/b")
    if base == "still-referred":
        shardsafe.save(f"{root}/c", state_at(4), overwrite=True, base=f"{root}/d")
        assert shardsafe.inspect(f"{root}/c").bases == ["b"]  # one hop: the frozen chunks d took from b
        delete_checkpoint(st, f"{root}/d")
        assert set(old) <= set(data(st, f"{root}/b"))
        holds(f"{root}/c", state_at(4))
        return
    shardsafe.save(f"{root}/c", state_at(5), overwrite=True)
    holds(f"{root}/c", state_at(5))
    if base == "retired":
        assert names(st, root) == ["c"]
    else:
        assert names(st, root) == ["b", "c"] and data(st, f"{root}/b") == new
        holds(f"{root}/b", OTHER)
