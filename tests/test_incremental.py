"""Incremental saves (``save(path, state, base=BASE)``, format v2 references; docs/incremental.md):
what is written, what loads, what verify/inspect say, which bases are refused, which references a
loader refuses, and that deletes never break a checkpoint that refers to another."""

from __future__ import annotations

import io
import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from hostile import as_version
from shardsafe.catalog.delete import delete_checkpoint
from shardsafe.catalog.names import TOMBSTONE
from shardsafe.cli.ls import ls_main
from shardsafe.engine.incremental import BaseRefusedError
from shardsafe.format.manifest import seal_manifest
from shardsafe.storage.local import LocalStorage


def frozen_state(frozen: int = 9, trained: int = 1, rows: int = 128) -> dict[str, Any]:
    """``frozen + trained`` tensors of equal size; the trained ones come last."""
    g = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {f"frozen{i}": torch.randn(rows, 256, generator=g) for i in range(frozen)}
    out.update({f"train{i}": torch.randn(rows, 256, generator=g) for i in range(trained)})
    out["step"] = 1
    return out


def step(state: dict[str, Any]) -> None:
    """A training step: the trained tensors change, the frozen ones do not."""
    for k, v in state.items():
        if k.startswith("train"):
            v.add_(0.5)
    state["step"] += 1


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def assert_loads_equal(path: Path | str, state: dict[str, Any]) -> None:
    out = shardsafe.load(path)
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(out[k], v), k
        else:
            assert out[k] == v, k


def manifest(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((path / "MANIFEST.json").read_text())
    return doc


def rewrite(path: Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` as the manifest, re-sealed as a hostile author would."""
    (path / "MANIFEST.json").write_text(json.dumps(seal_manifest(doc)))


def test_ninety_percent_unchanged_writes_at_most_015_of_a_full_save(tmp_path: Path) -> None:
    state = frozen_state()
    shardsafe.save(tmp_path / "s1", state)
    step(state)
    shardsafe.save(tmp_path / "s2", state, base=tmp_path / "s1")
    full, incr = disk_bytes(tmp_path / "s1"), disk_bytes(tmp_path / "s2")
    assert incr <= 0.15 * full, (incr, full)
    assert_loads_equal(tmp_path / "s2", state)
    summary = shardsafe.verify(tmp_path / "s2")
    assert summary.bytes >= 0.9 * full  # the referenced chunks are verified too, in the base's file
    info = shardsafe.inspect(tmp_path / "s2")
    assert info.format_version == 3 and info.bases == ["s1"] and info.referenced_bytes > 0
    parts = [shardsafe.verify(tmp_path / "s2", part=(i, 2)).bytes for i in range(2)]
    assert sum(parts) == summary.bytes and all(parts)  # ranks share the base's files too (resume verify)


def test_nothing_unchanged_writes_everything_and_a_full_save_has_no_references(tmp_path: Path) -> None:
    state = frozen_state(frozen=0, trained=4)
    shardsafe.save(tmp_path / "s1", state)
    step(state)
    shardsafe.save(tmp_path / "s2", state, base=tmp_path / "s1")
    assert manifest(tmp_path / "s2")["refs"] == {} and manifest(tmp_path / "s1")["refs"] == {}
    assert_loads_equal(tmp_path / "s2", state)


def test_references_stay_one_hop(tmp_path: Path) -> None:
    """s3's base s2 took its frozen chunks from s1: s3 refers to s1 for those, to s2 for the chunk
    that changed at s2 and not since."""
    state = frozen_state(frozen=2, trained=2)
    shardsafe.save(tmp_path / "s1", state)
    state["train0"].add_(1)
    shardsafe.save(tmp_path / "s2", state, base=tmp_path / "s1")
    state["train1"].add_(1)
    shardsafe.save(tmp_path / "s3", state, base=tmp_path / "s2")
    doc = manifest(tmp_path / "s3")
    refs = {name: t["chunks"][0]["ref"] for name, t in doc["tensors"].items()}
    assert refs == {"frozen0": "s1", "frozen1": "s1", "train0": "s2", "train1": None}
    assert sorted(doc["refs"]) == ["s1", "s2"]
    assert_loads_equal(tmp_path / "s3", state)
    shardsafe.verify(tmp_path / "s3")


def test_async_save_with_base_snapshots_and_refers(tmp_path: Path) -> None:
    state = frozen_state(frozen=3, trained=1)
    shardsafe.save(tmp_path / "s1", state)
    step(state)
    want = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    handle = shardsafe.async_save(tmp_path / "s2", state, base=tmp_path / "s1")
    step(state)  # after async_save returns, the state may change
    handle.wait()
    assert_loads_equal(tmp_path / "s2", want)
    assert sorted(manifest(tmp_path / "s2")["refs"]) == ["s1"]


def test_base_of_other_shapes_dtypes_or_world_size_is_simply_not_matched(tmp_path: Path) -> None:
    base = {"a": torch.arange(40.0).reshape(10, 4), "b": torch.arange(8, dtype=torch.int32), "c": torch.ones(3)}
    shardsafe.save(tmp_path / "s1", base)
    new = {
        "a": torch.arange(48.0).reshape(12, 4),  # other shape
        "b": torch.arange(8, dtype=torch.int64),  # other dtype
        "c": torch.ones(3),  # unchanged: referenced
    }
    shardsafe.save(tmp_path / "s2", new, base=tmp_path / "s1")
    refs = {name: t["chunks"][0]["ref"] for name, t in manifest(tmp_path / "s2")["tensors"].items()}
    assert refs == {"a": None, "b": None, "c": "s1"}
    assert_loads_equal(tmp_path / "s2", new)


def test_moved_away_base_gives_an_error_naming_it(tmp_path: Path) -> None:
    state = frozen_state(frozen=3, trained=1)
    shardsafe.save(tmp_path / "s1", state)
    step(state)
    shardsafe.save(tmp_path / "s2", state, base=tmp_path / "s1")
    shutil.move(tmp_path / "s1", tmp_path / "elsewhere")
    for call in (shardsafe.load, shardsafe.verify, shardsafe.inspect):
        with pytest.raises(shardsafe.CheckpointNotFoundError, match="base checkpoint 's1'") as err:
            call(tmp_path / "s2")
        assert "moved" in str(err.value) and "export" in str(err.value)
    with pytest.raises(shardsafe.CheckpointNotFoundError, match="'s1'"):
        shardsafe.load(tmp_path / "s2", {"frozen0": torch.zeros(128, 256)})
    out = io.StringIO()
    assert ls_main(str(tmp_path), verify=False, as_json=False, out=out) == 0
    (line,) = [line for line in out.getvalue().splitlines() if line.startswith("s2: ")]
    assert "missing base" in line and "'s1'" in line


@pytest.mark.parametrize("case", ["target", "missing", "uncommitted", "not-sibling", "hidden", "refers-to-target"])
def test_unusable_bases_are_refused_before_anything_is_written(tmp_path: Path, case: str) -> None:
    state = frozen_state(frozen=1, trained=1)
    shardsafe.save(tmp_path / "s1", state)
    target, base = tmp_path / "s2", tmp_path / "s1"
    if case == "target":
        target = base = tmp_path / "s1"
    elif case == "missing":
        base = tmp_path / "nope"
    elif case == "uncommitted":
        (tmp_path / "half").mkdir()
        (tmp_path / "half" / "data-00000-1abc.safetensors").write_bytes(b"x" * 16)
        base = tmp_path / "half"
    elif case == "not-sibling":
        shardsafe.save(tmp_path / "other" / "s1", state)
        base = tmp_path / "other" / "s1"
    elif case == "hidden":
        shardsafe.save(tmp_path / ".s0", state)
        base = tmp_path / ".s0"
    else:  # s3 refers to s1's data; replacing s1 with base=s3 would break s3
        step(state)
        shardsafe.save(tmp_path / "s3", state, base=tmp_path / "s1")
        target, base = tmp_path / "s1", tmp_path / "s3"
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(shardsafe.CheckpointError, match="base") as err:
        shardsafe.save(target, state, base=base, overwrite=True)
    assert base.name in str(err.value) or case == "target"
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written
    assert isinstance(err.value, (BaseRefusedError, ValueError))


def test_overwriting_the_base_keeps_the_checkpoints_that_refer_to_it_loadable(tmp_path: Path) -> None:
    state = frozen_state(frozen=3, trained=1)
    shardsafe.save(tmp_path / "s1", state)
    step(state)
    shardsafe.save(tmp_path / "s2", state, base=tmp_path / "s1")
    other = {"fresh": torch.full((4,), 7.0)}
    shardsafe.save(tmp_path / "s1", other, overwrite=True)  # the old s1's files must stay for s2
    assert_loads_equal(tmp_path / "s2", state)
    shardsafe.verify(tmp_path / "s2")
    assert_loads_equal(tmp_path / "s1", other)
    shardsafe.verify(tmp_path / "s1")


def test_deleting_a_referenced_checkpoint_retires_it_and_keeps_its_data_until_unreferenced(tmp_path: Path) -> None:
    state = frozen_state(frozen=3, trained=1)
    shardsafe.save(tmp_path / "s1", state)
    s1_files = sorted(p.name for p in (tmp_path / "s1").iterdir() if p.name.startswith("data-"))
    step(state)
    shardsafe.save(tmp_path / "s2", state, base=tmp_path / "s1")
    st = LocalStorage()
    delete_checkpoint(st, str(tmp_path / "s1"))
    with pytest.raises(shardsafe.CheckpointNotFoundError):
        shardsafe.load(tmp_path / "s1")  # retired: no longer committed
    assert sorted(p.name for p in (tmp_path / "s1").iterdir()) == sorted([*s1_files, TOMBSTONE])
    assert_loads_equal(tmp_path / "s2", state)
    shardsafe.verify(tmp_path / "s2")
    delete_checkpoint(st, str(tmp_path / "s2"))  # the last referrer: the retired base goes with it
    assert not (tmp_path / "s1").exists() and not (tmp_path / "s2").exists()


def _hostile(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    state = frozen_state(frozen=2, trained=1, rows=8)
    shardsafe.save(tmp_path / "s1", state)
    step(state)
    shardsafe.save(tmp_path / "s2", state, base=tmp_path / "s1")
    return tmp_path / "s2", manifest(tmp_path / "s2")


def _rename_ref(doc: dict[str, Any], new: str) -> None:
    doc["refs"] = {new: doc["refs"]["s1"]}
    for t in doc["tensors"].values():
        for c in t["chunks"]:
            if c["ref"] == "s1":
                c["ref"] = new


@pytest.mark.parametrize("ref", ["..", "../s1", "/tmp", "a/s1", "a\\s1", "", ".s1", "s2"])
def test_hostile_references_are_refused(tmp_path: Path, ref: str) -> None:
    path, doc = _hostile(tmp_path)
    _rename_ref(doc, ref)
    rewrite(path, doc)
    for call in (shardsafe.load, shardsafe.verify, shardsafe.inspect):
        with pytest.raises(shardsafe.CorruptCheckpointError):
            call(path)


def test_reference_to_a_sibling_not_listed_or_with_an_altered_file_is_refused(tmp_path: Path) -> None:
    path, doc = _hostile(tmp_path)
    fresh = json.loads(json.dumps(doc))
    for t in fresh["tensors"].values():  # a chunk naming a checkpoint that refs does not list
        for c in t["chunks"]:
            if c["ref"] == "s1":
                c["ref"] = "s0"
    rewrite(path, fresh)
    with pytest.raises(shardsafe.CorruptCheckpointError, match="refs does not list"):
        shardsafe.load(path)
    for field, value in (("header_checksum", "0" * 16), ("size", None)):
        altered = json.loads(json.dumps(doc))
        (entry,) = altered["refs"]["s1"]["files"].values()
        entry[field] = value if value is not None else entry["size"] + 8
        rewrite(path, altered)
        with pytest.raises(shardsafe.CorruptCheckpointError, match="s1"):
            shardsafe.load(path)
        with pytest.raises(shardsafe.CorruptCheckpointError):
            shardsafe.verify(path)
    # a base replaced by another save of the same name: same file names cannot come back, but a
    # rewritten file of the same size with another header must not be read as the referenced one
    rewrite(path, doc)
    (data,) = (tmp_path / "s1").glob("data-*.safetensors")
    raw = bytearray(data.read_bytes())
    raw[20] ^= 1  # inside the header
    data.write_bytes(bytes(raw))
    with pytest.raises(shardsafe.CorruptCheckpointError, match="s1"):
        shardsafe.load(path)


def test_version_1_checkpoints_still_load_and_serve_as_a_base(tmp_path: Path) -> None:
    state = frozen_state(frozen=2, trained=1, rows=8)
    shardsafe.save(tmp_path / "s1", state)
    as_version(tmp_path / "s1", 1)  # no refs, digests nor (v3) data file index
    assert shardsafe.inspect(tmp_path / "s1").format_version == 1
    assert_loads_equal(tmp_path / "s1", state)
    shardsafe.verify(tmp_path / "s1")
    shardsafe.save(tmp_path / "s2", state, base=tmp_path / "s1")  # no digests to compare: all written
    assert manifest(tmp_path / "s2")["refs"] == {}
    assert_loads_equal(tmp_path / "s2", state)


def test_export_shardsafe_writes_a_self_contained_copy(tmp_path: Path) -> None:
    from shardsafe.cli import main

    state = frozen_state(frozen=3, trained=1, rows=16)
    shardsafe.save(tmp_path / "s1", state)
    step(state)
    shardsafe.save(tmp_path / "s2", state, base=tmp_path / "s1", metadata={"step": 2})
    assert main(["export", str(tmp_path / "s2"), str(tmp_path / "out" / "copy"), "--format", "shardsafe"]) == 0
    shutil.rmtree(tmp_path / "s1")
    copy = tmp_path / "out" / "copy"
    assert manifest(copy)["refs"] == {}
    assert_loads_equal(copy, state)
    shardsafe.verify(copy)
    assert shardsafe.inspect(copy).metadata == {"step": 2}


def test_incremental_saves_on_an_object_store(tmp_path: Path) -> None:
    from shardsafe.storage.remote import FsspecStorage

    root = f"memory://inc-{uuid.uuid4().hex[:8]}/run"
    state = frozen_state(frozen=3, trained=1, rows=16)
    shardsafe.save(f"{root}/s1", state)
    step(state)
    shardsafe.save(f"{root}/s2", state, base=f"{root}/s1")
    assert shardsafe.inspect(f"{root}/s2").bases == ["s1"]
    assert_loads_equal(f"{root}/s2", state)
    shardsafe.verify(f"{root}/s2")
    st = FsspecStorage.for_path(root)
    delete_checkpoint(st, f"{root}/s1")  # retired, its data kept for s2
    assert_loads_equal(f"{root}/s2", state)
    delete_checkpoint(st, f"{root}/s2")
    assert st.list_dir(root) == []


def test_per_rank_values_are_referenced_like_any_chunk(tmp_path: Path) -> None:
    state = {"w": torch.ones(64, 64), "rng": shardsafe.per_rank(torch.arange(50.0))}
    shardsafe.save(tmp_path / "s1", state)
    state["w"] += 1
    shardsafe.save(tmp_path / "s2", state, base=tmp_path / "s1")
    refs = {name: t["chunks"][0]["ref"] for name, t in manifest(tmp_path / "s2")["tensors"].items()}
    assert refs == {"w": None, "/rank0/rng": "s1"}
    into = {"w": torch.zeros(64, 64), "rng": shardsafe.per_rank(torch.zeros(50))}
    shardsafe.load(tmp_path / "s2", into)
    assert torch.equal(into["w"], state["w"]) and torch.equal(into["rng"].value, torch.arange(50.0))
    shardsafe.verify(tmp_path / "s2")
