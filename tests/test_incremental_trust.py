"""An incremental save takes nothing of its base on trust (docs/incremental.md, "What is verified"):
a base chunk is referred to only after its bytes were read back and checked against the base's block
checksums and its content digest, in a file whose size and header match what the new manifest will
record; anything else is written in full, with one WARNING naming the base file. And the manager's
incremental saves go on after a damaged base, retention never deletes through a symlinked checkpoint
folder, and values the format cannot hold are refused by name before anything is written."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

import shardsafe
from shardsafe.manager import CheckpointManager
from test_incremental import assert_loads_equal, frozen_state, manifest, rewrite, step

BLOCK = 1024  # checksum block for these tests: a 16-row chunk (16 KiB) spans 16 blocks


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDSAFE_CHECKSUM_BLOCK_BYTES", str(BLOCK))


def chunk(path: Path, tensor: str) -> dict[str, Any]:
    (c,) = manifest(path)["tensors"][tensor]["chunks"]
    return dict(c)


def flip(file: Path, at: int) -> None:
    raw = bytearray(file.read_bytes())
    raw[at] ^= 0x10
    file.write_bytes(bytes(raw))


def refs_of(path: Path) -> dict[str, str | None]:
    return {name: t["chunks"][0]["ref"] for name, t in manifest(path)["tensors"].items()}


def warnings_about(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage()]


def _chain(tmp_path: Path, hop: bool) -> tuple[dict[str, Any], Path, Path]:
    """(state, the base to save on, the checkpoint holding the frozen tensors' bytes): s1 full; with
    ``hop``, s2 on s1 as well, whose frozen chunks refer to s1 (the next save reaches s1 through s2)."""
    state = frozen_state(frozen=3, trained=1, rows=16)
    shardsafe.save(tmp_path / "s1", state)
    base = tmp_path / "s1"
    if hop:
        step(state)
        shardsafe.save(tmp_path / "s2", state, base=base)
        assert refs_of(tmp_path / "s2")["frozen1"] == "s1"
        base = tmp_path / "s2"
    step(state)
    return state, base, tmp_path / "s1"


@pytest.mark.parametrize("hop", [False, True], ids=["direct", "one-hop"])
def test_bit_rot_in_a_base_chunk_is_written_in_full(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, hop: bool
) -> None:
    """Fails before: the save referred to the rotten chunk and committed a checkpoint that verify and
    load refuse."""
    state, base, holder = _chain(tmp_path, hop)
    c = chunk(holder, "frozen1")
    flip(holder / c["file"], c["begin"] + 5 * BLOCK + 3)
    with caplog.at_level(logging.WARNING, logger="shardsafe"):
        shardsafe.save(tmp_path / "new", state, base=base)
    shardsafe.verify(tmp_path / "new")
    assert_loads_equal(tmp_path / "new", state)
    refs = refs_of(tmp_path / "new")
    assert refs["frozen1"] is None and refs["frozen0"] == refs["frozen2"] == "s1"  # the sound ones still referred to
    assert len(warnings_about(caplog, str(holder / c["file"]))) == 1, caplog.text


@pytest.mark.parametrize("hop", [False, True], ids=["direct", "one-hop"])
def test_a_damaged_base_header_makes_its_chunks_written_in_full(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, hop: bool
) -> None:
    """Fails before: the header checksum was copied from the base's manifest, never checked against the
    file: the save committed, and loading the new checkpoint fails on the header."""
    state, base, holder = _chain(tmp_path, hop)
    file = holder / chunk(holder, "frozen1")["file"]
    flip(file, 30)  # inside the safetensors header's JSON
    with caplog.at_level(logging.WARNING, logger="shardsafe"):
        shardsafe.save(tmp_path / "new", state, base=base)
    shardsafe.verify(tmp_path / "new")
    assert_loads_equal(tmp_path / "new", state)
    assert all(ref != "s1" for ref in refs_of(tmp_path / "new").values())
    assert len(warnings_about(caplog, str(file))) == 1, caplog.text


def _stale_digest(path: Path, tensor: str, new: torch.Tensor, referrers: tuple[Path, ...] = ()) -> None:
    """Replace the bytes of ``tensor`` in the checkpoint at ``path`` with those of ``new`` and make its
    block checksums right again (in ``referrers`` too, whose chunks refer to it), leaving the content
    digest as it was: checkpoints that verify and load (the spec checks a digest's form only), whose
    digest no longer describes the bytes."""
    doc = manifest(path)
    (c,) = doc["tensors"][tensor]["chunks"]
    raw = new.contiguous().view(torch.uint8).numpy().tobytes()
    assert len(raw) == c["end"] - c["begin"]
    file = path / c["file"]
    data = bytearray(file.read_bytes())
    data[c["begin"] : c["end"]] = raw
    file.write_bytes(bytes(data))
    sums = [xxhash.xxh3_64_hexdigest(raw[i : i + BLOCK]) for i in range(0, len(raw), BLOCK)]
    c["checksums"] = sums
    rewrite(path, doc)
    for other in referrers:
        theirs = manifest(other)
        for t in theirs["tensors"].values():
            for rc in t["chunks"]:
                if rc["ref"] == path.name and (rc["file"], rc["begin"]) == (c["file"], c["begin"]):
                    rc["checksums"] = sums
        rewrite(other, theirs)


@pytest.mark.parametrize("hop", [False, True], ids=["direct", "one-hop"])
def test_a_stale_digest_never_makes_a_save_load_the_bases_bytes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, hop: bool
) -> None:
    """Fails before: the digests compared equal, the chunk was referred to, and the new checkpoint
    loaded the base's (other) bytes instead of the state saved: silently wrong weights."""
    state, base, holder = _chain(tmp_path, hop)
    _stale_digest(holder, "frozen1", state["frozen1"] + 1, (base,) if hop else ())
    shardsafe.verify(base)  # the base is a valid checkpoint
    assert not torch.equal(shardsafe.load(base)["frozen1"], state["frozen1"])
    with caplog.at_level(logging.WARNING, logger="shardsafe"):
        shardsafe.save(tmp_path / "new", state, base=base)
    assert_loads_equal(tmp_path / "new", state)
    shardsafe.verify(tmp_path / "new")
    assert refs_of(tmp_path / "new")["frozen1"] is None
    assert len(warnings_about(caplog, str(holder / chunk(holder, "frozen1")["file"]))) == 1, caplog.text


def test_a_missing_or_truncated_base_file_of_one_hop_is_written_in_full(tmp_path: Path) -> None:
    """s2's frozen chunks live in s1; s1's file truncated: a save on s2 writes them (it used to be refused
    as a whole, or fail at the commit)."""
    state, base, holder = _chain(tmp_path, hop=True)
    file = holder / chunk(holder, "frozen1")["file"]
    os.truncate(file, file.stat().st_size - 100)
    shardsafe.save(tmp_path / "new", state, base=base)
    assert_loads_equal(tmp_path / "new", state)
    shardsafe.verify(tmp_path / "new")
    assert "s1" not in manifest(tmp_path / "new")["refs"]


def test_an_async_save_verifies_its_base_too(tmp_path: Path) -> None:
    state, base, holder = _chain(tmp_path, hop=False)
    _stale_digest(holder, "frozen2", state["frozen2"] * 2)
    handle = shardsafe.async_save(tmp_path / "new", state, base=base)
    handle.wait()
    assert_loads_equal(tmp_path / "new", state)
    assert refs_of(tmp_path / "new")["frozen2"] is None and refs_of(tmp_path / "new")["frozen0"] == "s1"


# ------------------------------------------------------------------ a data file of another valid name


@pytest.mark.parametrize("name", ["weights.safetensors", "data-00000-0other0.safetensors"])
def test_a_base_data_file_of_another_valid_name_is_written_in_full(tmp_path: Path, name: str) -> None:
    """Fails before: the new manifest referred to the file by a name the refs table may not hold (a
    referenced file is a data file of the base's save id), and the writer's own check refused it."""
    state = frozen_state(frozen=2, trained=1, rows=16)
    shardsafe.save(tmp_path / "s1", state)
    doc = manifest(tmp_path / "s1")
    (old,) = doc["files"]
    os.rename(tmp_path / "s1" / old, tmp_path / "s1" / name)
    doc["files"] = {name: doc["files"][old]}
    for t in doc["tensors"].values():
        for c in t["chunks"]:
            c["file"] = name
    rewrite(tmp_path / "s1", doc)
    shardsafe.verify(tmp_path / "s1")  # a valid checkpoint: any plain file name is
    step(state)
    shardsafe.save(tmp_path / "s2", state, base=tmp_path / "s1")
    assert manifest(tmp_path / "s2")["refs"] == {}
    assert_loads_equal(tmp_path / "s2", state)
    shardsafe.verify(tmp_path / "s2")


# ------------------------------------------------------------------------- the manager goes on


def expected(at: int) -> dict[str, Any]:
    state = frozen_state(frozen=3, trained=1, rows=16)
    for _ in range(at - 1):
        step(state)
    return state


def _damage(root: Path, how: str) -> None:
    newest, oldest = root / "step-00000003", root / "step-00000001"
    where = oldest if how.startswith("oldest") else newest
    c = chunk(where, "frozen1")
    file = where / c["file"]
    if how.endswith("truncate"):
        os.truncate(file, file.stat().st_size - 8)
    elif how.endswith("delete"):
        file.unlink()
    elif how.endswith("flip data"):
        flip(file, c["begin"] + 7)
    elif how.endswith("flip header"):
        flip(file, 30)
    elif how.endswith("stale digest"):
        referrers = () if where == newest else tuple(root / f"step-0000000{i}" for i in (2, 3))
        _stale_digest(where, "frozen1", torch.zeros(16, 256), referrers)


@pytest.mark.parametrize(
    "how",
    [
        "newest truncate",
        "newest delete",
        "newest flip data",
        "newest flip header",
        "newest stale digest",
        "oldest truncate",
        "oldest flip data",
        "oldest flip header",
        "oldest stale digest",
    ],
)
def test_a_damaged_base_never_stops_the_manager_from_checkpointing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    """Saves 1, 2 and 3, then damage to the newest (3, a full save: the next save refers to its file)
    or to the oldest (1, full, whose file 2 and 3 refer to for the frozen tensors). Saves 4 and 5
    commit and hold exactly the state saved, with a WARNING naming the damaged checkpoint. Fails
    before: every save after a truncated or deleted base file failed at the commit; one after a
    flipped byte or a stale digest committed a checkpoint that does not verify or holds the base's
    bytes."""
    state = expected(1)
    every = 2 if how.startswith("newest") else 10  # 2: saves 1 and 3 are full
    with CheckpointManager(tmp_path, incremental=True, full_save_every=every, keep_last=None, save_on_signals=()) as m:
        for s in (1, 2, 3):
            m.save(s, state)
            step(state)
    holder = "step-00000003" if how.startswith("newest") else "step-00000001"
    assert chunk(tmp_path / holder, "frozen1")["ref"] is None
    assert refs_of(tmp_path / "step-00000003")["frozen1"] in (None, holder)
    _damage(tmp_path, how)
    with (
        caplog.at_level(logging.WARNING, logger="shardsafe"),
        CheckpointManager(tmp_path, incremental=True, full_save_every=10, keep_last=None, save_on_signals=()) as mgr,
    ):
        for s in (4, 5):
            mgr.save(s, state)
            shardsafe.verify(tmp_path / f"step-{s:08d}")
            assert_loads_equal(tmp_path / f"step-{s:08d}", state)
            step(state)
    assert shardsafe.inspect(tmp_path / "step-00000005").bases  # incremental again after the damage
    assert warnings_about(caplog, holder), caplog.text


# --------------------------------------------------------------------- retention and symlinks


def _outside(tmp_path: Path) -> tuple[Path, list[tuple[str, int]]]:
    """A committed checkpoint outside the manager's root, and a listing of what it holds."""
    elsewhere = tmp_path / "elsewhere" / "kept"
    shardsafe.save(elsewhere, {"w": torch.ones(8)}, metadata={"step": 1})
    return elsewhere, _listing(elsewhere)


def _listing(path: Path) -> list[tuple[str, int]]:
    return sorted((p.name, p.stat().st_size) for p in path.iterdir())


@pytest.mark.parametrize("incremental", [False, True])
def test_retention_never_deletes_through_a_symlinked_checkpoint_folder(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, incremental: bool
) -> None:
    """Fails before: step-00000001, a symlink to a checkpoint elsewhere, was retention's oldest: the
    checkpoint it points to lost its manifest and data files. Now the link and what it points to stay,
    with a WARNING saying so."""
    elsewhere, before = _outside(tmp_path)
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(elsewhere, root / "step-00000001")
    state = frozen_state(frozen=1, trained=1, rows=8)
    with (
        caplog.at_level(logging.WARNING, logger="shardsafe"),
        CheckpointManager(root, keep_last=1, incremental=incremental, leftover_age=0, save_on_signals=()) as mgr,
    ):
        for s in (2, 3, 4):
            mgr.save(s, state)
            step(state)
        kept = [r.name for r in mgr.list()]
    assert _listing(elsewhere) == before
    shardsafe.verify(elsewhere)
    assert (root / "step-00000001").is_symlink()
    assert kept == ["step-00000001", "step-00000004"]  # the link is listed, and never deleted
    assert warnings_about(caplog, "symbolic link"), caplog.text


@pytest.mark.parametrize("what", ["retired", "uncommitted", "unlisted file"])
def test_leftover_cleanup_never_deletes_through_a_symlinked_folder(tmp_path: Path, what: str) -> None:
    """Fails before: the leftover cleanup finished a deletion, or removed data files by name, inside
    the folder a root entry links to."""
    elsewhere, _ = _outside(tmp_path)
    (f,) = [p for p in elsewhere.iterdir() if p.name.startswith("data-")]
    if what == "retired":
        os.rename(elsewhere / "MANIFEST.json", elsewhere / ".MANIFEST.json.deleting")
    elif what == "uncommitted":
        (elsewhere / "MANIFEST.json").unlink()
    else:
        shutil.copyfile(f, elsewhere / "data-00003-0abc.safetensors")
    before = _listing(elsewhere)
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(elsewhere, root / "step-00000001")
    old = os.stat(elsewhere).st_mtime - 3600
    for p in [elsewhere, *elsewhere.iterdir()]:
        os.utime(p, (old, old))
    with CheckpointManager(root, keep_last=5, leftover_age=0, save_on_signals=()) as mgr:
        mgr.save(2, {"w": torch.zeros(4)})
    assert _listing(elsewhere) == before
    assert (root / "step-00000001").is_symlink()


def test_deleting_a_checkpoint_through_a_symlink_is_refused_by_the_delete_gate(tmp_path: Path) -> None:
    from shardsafe.catalog.delete import delete_checkpoint, finish_deletion
    from shardsafe.storage.local import LocalStorage

    elsewhere, before = _outside(tmp_path)
    os.symlink(elsewhere, tmp_path / "link")
    with pytest.raises(ValueError, match="symbolic link"):
        delete_checkpoint(LocalStorage(), str(tmp_path / "link"))
    os.rename(elsewhere / "MANIFEST.json", elsewhere / ".MANIFEST.json.deleting")
    assert finish_deletion(LocalStorage(), str(tmp_path / "link")) == []
    os.rename(elsewhere / ".MANIFEST.json.deleting", elsewhere / "MANIFEST.json")
    assert _listing(elsewhere) == before


def test_releasing_the_old_files_of_an_overwritten_base_never_goes_through_a_symlink(tmp_path: Path) -> None:
    """c refers to b's files; b is then moved elsewhere and root/b made a link to it; c is deleted: its
    release of b's files would remove them from the folder elsewhere. Fails before: they were removed
    (b was overwritten through the link first, which a save now refuses, as it refuses a base that is a
    link out of the folder)."""
    from shardsafe.catalog.delete import delete_checkpoint
    from shardsafe.storage.local import LocalStorage

    state = frozen_state(frozen=2, trained=1, rows=8)
    root = tmp_path / "root"
    shardsafe.save(root / "b", state)
    step(state)
    shardsafe.save(root / "c", state, base=root / "b")
    assert manifest(root / "c")["refs"]
    elsewhere = tmp_path / "elsewhere" / "b"
    elsewhere.parent.mkdir()
    os.rename(root / "b", elsewhere)
    os.symlink(elsewhere, root / "b")
    old = sorted(p.name for p in elsewhere.iterdir() if p.name.startswith("data-"))
    with pytest.raises(shardsafe.CheckpointExistsError, match="symbolic link"):
        shardsafe.save(root / "b", {"other": torch.ones(3)}, overwrite=True)
    with pytest.raises(shardsafe.CheckpointError, match="symbolic link"):
        shardsafe.save(root / "d", state, base=root / "b")
    delete_checkpoint(LocalStorage(), str(root / "c"))
    assert set(old) <= {p.name for p in elsewhere.iterdir()}
    shardsafe.verify(elsewhere)


# ---------------------------------------------------------- refused by name before anything is written


def _lone(text: str) -> str:
    return text + "\ud800"


@pytest.mark.parametrize(
    ("state", "named"),
    [
        ({"deep": torch.zeros([1] * 80)}, "'deep'"),
        ({"huge": torch.empty(0, 2**62)}, "'huge'"),
        ({"opt": {"wide": torch.empty(2**32, 0, 2**31, dtype=torch.uint8)}}, "'opt/wide'"),
        ({_lone("w"): torch.zeros(2)}, "'w\\ud800'"),
        ({"model": {_lone("layer"): torch.zeros(2)}}, "'model/layer\\ud800'"),
        ({"values": {"name": _lone("abc")}}, "'values/name'"),
        ({"values": [1, {_lone("k"): 1}]}, "'values/1/k\\ud800'"),
        ({_lone("plain"): 3}, "'plain\\ud800'"),
        ({"values": {"n": 10**5000}}, "'values/n'"),
        ({"values": {10**5000: 1}}, "'values'"),
        ({"opt": {"k" * 70_000: torch.zeros(1)}}, "'opt/kkkk"),
    ],
    ids=[
        "80-dims",
        "shape-2**62",
        "bytes-over-2**62",
        "tensor-key",
        "nested-tensor-key",
        "str-value",
        "dict-key",
        "key",
        "int-5000-digits",
        "int-key",
        "name-70000",
    ],
)
def test_what_the_format_cannot_hold_is_refused_by_name_before_anything_is_written(
    tmp_path: Path, state: dict[str, Any], named: str
) -> None:
    """Fails before: these were written, then refused by the writer's post-check ("the manifest built
    from the reports does not validate"), or failed on a UnicodeEncodeError, without naming the key."""
    with pytest.raises(shardsafe.UnsafeValueError) as err:
        shardsafe.save(tmp_path / "ckpt", state)
    assert named in str(err.value), str(err.value)
    assert "does not validate" not in str(err.value)
    assert os.listdir(tmp_path) == []


def test_a_lone_surrogate_in_metadata_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(shardsafe.UnsafeValueError, match="metadata/note"):
        shardsafe.save(tmp_path / "ckpt", {"w": torch.zeros(2)}, metadata={"note": _lone("x")})
    assert os.listdir(tmp_path) == []


def test_a_dtype_the_format_cannot_hold_is_refused_without_naming_an_old_version(tmp_path: Path) -> None:
    with pytest.raises(shardsafe.UnsafeValueError, match="'q'") as err:
        shardsafe.save(tmp_path / "ckpt", {"q": torch.zeros(2, dtype=torch.complex128)})
    assert "format v1" not in str(err.value) and "format v3" in str(err.value)


def test_the_format_doc_names_version_3() -> None:
    text = (Path(__file__).resolve().parents[1] / "docs" / "format.md").read_text()
    assert "equal to 1" not in text and "equal to 3" in text
