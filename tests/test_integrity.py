"""Corrupt and hostile checkpoints: flipped bytes, truncated and missing files, altered manifests, path
traversal, absurd shapes and ranges, pickle payloads, unknown kinds and tags. Each is refused with the
exact error class and a message naming the file (and tensor or entry where there is one)."""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

import shardsafe
from shardsafe import CheckpointNotFoundError, CorruptCheckpointError
from shardsafe.format.manifest import seal_manifest

BLOCK = 64  # checksum block for these tests: tensor "x" (160 bytes) spans three blocks
Doc = dict[str, Any]


def _state() -> dict[str, Any]:
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.copy_(torch.arange(12, dtype=torch.float32).reshape(3, 4))
        model.bias.copy_(torch.tensor([0.5, -0.5, 2.0]))
    return {"model": model, "x": torch.arange(40, dtype=torch.float32).reshape(10, 4), "step": 7}


@pytest.fixture
def ckpt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SHARDSAFE_CHECKSUM_BLOCK_BYTES", str(BLOCK))
    path = tmp_path / "ckpt"
    shardsafe.save(path, _state())
    return path


def manifest_of(path: Path) -> Doc:
    doc: Doc = json.loads((path / "MANIFEST.json").read_text())
    return doc


def edit_manifest(path: Path, change: Callable[[Doc], None]) -> None:
    """A crafted manifest: a hostile author recomputes the manifest's own checksum, so the edit must be
    caught by validation itself (an unsealed edit is caught earlier: see test_unsealed_edit_...)."""
    doc = manifest_of(path)
    change(doc)
    (path / "MANIFEST.json").write_text(json.dumps(seal_manifest(doc)))


def data_file(path: Path) -> Path:
    (name,) = manifest_of(path)["files"]
    return path / str(name)


def chunk_of(doc: Doc, tensor: str) -> Doc:
    chunk: Doc = doc["tensors"][tensor]["chunks"][0]
    return chunk


def flip(file: Path, offset: int) -> None:
    raw = bytearray(file.read_bytes())
    raw[offset] ^= 0x01
    file.write_bytes(bytes(raw))


def raises_naming(err: type[Exception], fn: Callable[[], object], *names: str) -> str:
    """Assert ``fn()`` raises exactly ``err`` whose message contains every one of ``names``."""
    with pytest.raises(err) as info:
        fn()
    assert type(info.value) is err, f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    for name in names:
        assert name in message, f"{name!r} not in {message!r}"
    return message


def readers(path: Path) -> list[Callable[[], object]]:
    """Every way to read a checkpoint: load whole, load into a state, verify."""
    dest = {"model": torch.nn.Linear(4, 3), "x": torch.zeros(10, 4), "step": 0}
    return [lambda: shardsafe.load(path), lambda: shardsafe.load(path, dest), lambda: shardsafe.verify(path)]


def manifest_readers(path: Path) -> list[Callable[[], object]]:
    return [*readers(path), lambda: shardsafe.inspect(path)]


# ------------------------------------------------------------------------------ data files


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flipped_data_byte(ckpt: Path, where: str) -> None:
    c = chunk_of(manifest_of(ckpt), "x")
    offset = {"first": c["begin"], "middle": c["begin"] + BLOCK + 5, "last": c["end"] - 1}[where]
    flip(data_file(ckpt), offset)
    for read in readers(ckpt):
        msg = raises_naming(CorruptCheckpointError, read, str(data_file(ckpt)), "'x'", "checksum mismatch")
        assert "restore" in msg or "older checkpoint" in msg


def test_flipped_byte_names_its_tensor(ckpt: Path) -> None:
    flip(data_file(ckpt), chunk_of(manifest_of(ckpt), "model/bias")["begin"])
    for read in readers(ckpt):
        raises_naming(CorruptCheckpointError, read, str(data_file(ckpt)), "'model/bias'")


@pytest.mark.parametrize("offset", [0, 7, 8, 20, -1])
def test_flipped_header_byte(ckpt: Path, offset: int) -> None:
    """The safetensors header (length prefix, JSON, padding) is covered by the header checksum."""
    header_bytes = manifest_of(ckpt)["files"][data_file(ckpt).name]["header_bytes"]
    flip(data_file(ckpt), offset % header_bytes)
    raises_naming(CorruptCheckpointError, lambda: shardsafe.verify(ckpt), str(data_file(ckpt)), "header")


@pytest.mark.parametrize("keep", [0, 7, 100, -1])
def test_truncated_data_file(ckpt: Path, keep: int) -> None:
    file = data_file(ckpt)
    size = file.stat().st_size
    os.truncate(file, keep % size)
    load_whole, load_into, verify = readers(ckpt)
    raises_naming(CorruptCheckpointError, verify, str(file), "truncated")
    raises_naming(CorruptCheckpointError, load_whole, str(file), "truncated")
    raises_naming(CorruptCheckpointError, load_into, str(file), "truncated")


def test_missing_data_file(ckpt: Path) -> None:
    file = data_file(ckpt)
    file.unlink()
    for read in readers(ckpt):
        raises_naming(CorruptCheckpointError, read, str(file))


def test_extra_bytes_after_data_file(ckpt: Path) -> None:
    file = data_file(ckpt)
    with open(file, "ab") as f:
        f.write(b"\0")
    raises_naming(CorruptCheckpointError, lambda: shardsafe.verify(ckpt), str(file), "manifest says")


# ---------------------------------------------------------------------------- the manifest


def test_unsealed_edit_of_a_value_fails_the_manifest_checksum(ckpt: Path) -> None:
    manifest = ckpt / "MANIFEST.json"
    doc = manifest_of(ckpt)
    doc["objects"]["step"]["value"] = 6  # a single changed value, checksum left as it was
    manifest.write_text(json.dumps(doc))
    for read in manifest_readers(ckpt):
        raises_naming(CorruptCheckpointError, read, str(manifest), "own checksum")


@pytest.mark.parametrize("damage", ["flip first byte", "truncate", "empty", "not utf-8", "array", "null"])
def test_manifest_not_a_json_object(ckpt: Path, damage: str) -> None:
    manifest = ckpt / "MANIFEST.json"
    raw = manifest.read_bytes()
    manifest.write_bytes(
        {
            "flip first byte": bytes([raw[0] ^ 1]) + raw[1:],
            "truncate": raw[: len(raw) // 2],
            "empty": b"",
            "not utf-8": b"\xff\xfe" + raw,
            "array": b"[1, 2]",
            "null": b"null",
        }[damage]
    )
    for read in manifest_readers(ckpt):
        raises_naming(CorruptCheckpointError, read, str(manifest))


@pytest.mark.parametrize("shape", [[10, 5], [11, 4], [40], [10, 4, 1], [4, 10], [0, 4]])
def test_manifest_with_altered_shape(ckpt: Path, shape: list[int]) -> None:
    edit_manifest(ckpt, lambda d: d["tensors"]["x"].update(shape=shape))
    for read in manifest_readers(ckpt):
        raises_naming(CorruptCheckpointError, read, str(ckpt / "MANIFEST.json"), "'x'")


def test_manifest_with_altered_dtype(ckpt: Path) -> None:
    edit_manifest(ckpt, lambda d: d["tensors"]["x"].update(dtype="float64"))
    for read in manifest_readers(ckpt):
        raises_naming(CorruptCheckpointError, read, str(ckpt / "MANIFEST.json"), "'x'", "does not fit")


@pytest.mark.parametrize("dtype", ["evil", "os.system", "Tensor", "complex128", 5])
def test_manifest_with_unknown_dtype(ckpt: Path, dtype: Any) -> None:
    edit_manifest(ckpt, lambda d: d["tensors"]["x"].update(dtype=dtype))
    for read in manifest_readers(ckpt):
        raises_naming(CorruptCheckpointError, read, str(ckpt / "MANIFEST.json"), "'x'", "dtype")


def test_manifest_with_altered_checksum(ckpt: Path) -> None:
    def change(d: Doc) -> None:
        sums = chunk_of(d, "x")["checksums"]
        sums[1] = "0" * 16

    edit_manifest(ckpt, change)
    for read in readers(ckpt):
        raises_naming(CorruptCheckpointError, read, str(data_file(ckpt)), "'x'", "checksum mismatch")


def test_manifest_with_altered_header_checksum_or_size(ckpt: Path) -> None:
    name = data_file(ckpt).name
    edit_manifest(ckpt, lambda d: d["files"][name].update(header_checksum="0" * 16))
    raises_naming(CorruptCheckpointError, lambda: shardsafe.verify(ckpt), str(data_file(ckpt)), "header checksum")


def test_manifest_with_shifted_byte_range(ckpt: Path) -> None:
    """A chunk pointed at other bytes of the same file (same length) fails its checksums."""

    def change(d: Doc) -> None:
        c = chunk_of(d, "model/bias")
        c["begin"] -= 4
        c["end"] -= 4

    edit_manifest(ckpt, change)
    for read in readers(ckpt):
        raises_naming(CorruptCheckpointError, read, str(data_file(ckpt)))


@pytest.mark.parametrize("count", [2, 4, 0])
def test_checksum_count_mismatch(ckpt: Path, count: int) -> None:
    def change(d: Doc) -> None:
        sums = chunk_of(d, "x")["checksums"]
        chunk_of(d, "x")["checksums"] = (sums * 2)[:count]

    edit_manifest(ckpt, change)
    for read in manifest_readers(ckpt):
        raises_naming(CorruptCheckpointError, read, str(ckpt / "MANIFEST.json"), "'x'", f"{count} checksums")


# ----------------------------------------------------------------------- hostile manifests

HOSTILE_NAMES = ["../x", "/etc/passwd", "a/b", "..", ".hidden", "", "a\\b", "x\0y", "MANIFEST/../../z"]


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_path_traversal_in_files(ckpt: Path, name: str) -> None:
    (ckpt.parent / "x").write_bytes(data_file(ckpt).read_bytes())  # what "../x" would reach

    def change(d: Doc) -> None:
        (old,) = d["files"]
        d["files"] = {name: d["files"][old]}
        for t in d["tensors"].values():
            for c in t["chunks"]:
                c["file"] = name

    edit_manifest(ckpt, change)
    for read in manifest_readers(ckpt):
        raises_naming(CorruptCheckpointError, read, str(ckpt / "MANIFEST.json"), repr(name), "not a plain name")


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_path_traversal_in_chunk_records(ckpt: Path, name: str) -> None:
    edit_manifest(ckpt, lambda d: chunk_of(d, "x").update(file=name))
    for read in manifest_readers(ckpt):
        raises_naming(CorruptCheckpointError, read, str(ckpt / "MANIFEST.json"), "'x'", repr(name))


def test_chunk_in_unlisted_file(ckpt: Path) -> None:
    edit_manifest(ckpt, lambda d: chunk_of(d, "x").update(file="data-00009-other.safetensors"))
    for read in manifest_readers(ckpt):
        raises_naming(CorruptCheckpointError, read, "'x'", "unlisted file 'data-00009-other.safetensors'")


def _set_x(shape: list[int], sizes: list[int], end_delta: int = 0) -> Callable[[Doc], None]:
    def change(d: Doc) -> None:
        d["tensors"]["x"]["shape"] = shape
        c = chunk_of(d, "x")
        c["sizes"] = sizes
        c["end"] += end_delta

    return change


def _past_end(d: Doc) -> None:
    """Chunk "x" moved to end 4 bytes after its file, its length unchanged."""
    c = chunk_of(d, "x")
    size = d["files"][c["file"]]["size"]
    c["begin"], c["end"] = size + 4 - (c["end"] - c["begin"]), size + 4


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (_set_x([2**40, 2**40], [2**40, 2**40]), "absurdly large"),
        (_set_x([2**62, 4], [10, 4]), "absurdly large"),
        (_set_x([10, 4], [11, 4]), "outside"),
        (_past_end, "outside the data"),
        (_set_x([10, 4], [10, 4], end_delta=2**50), "outside the data"),
        (lambda d: chunk_of(d, "x").update(begin=0), "outside the data"),
        (lambda d: chunk_of(d, "x").update(offsets=[1, 0]), "outside"),
        (lambda d: chunk_of(d, "x").update(offsets=[0]), "does not match shape"),
        (lambda d: d["tensors"]["x"].update(chunks=[]), "chunks hold 0 elements"),
        (lambda d: d["tensors"]["x"]["chunks"].append(chunk_of(d, "x")), "chunks hold 80 elements"),
    ],
    ids=[
        "shape 2^40x2^40",
        "shape 2^62x4",
        "chunk larger than shape",
        "range past file end",
        "range far past file end",
        "range inside header",
        "chunk shifted out of shape",
        "chunk rank mismatch",
        "no chunks",
        "duplicate chunk",
    ],
)
def test_absurd_shapes_and_ranges(ckpt: Path, change: Callable[[Doc], None], match: str) -> None:
    edit_manifest(ckpt, change)
    for read in manifest_readers(ckpt):
        raises_naming(CorruptCheckpointError, read, str(ckpt / "MANIFEST.json"), "'x'", match)


@pytest.mark.parametrize(
    ("change", "what"),
    [
        (lambda d: d["tensors"]["x"].update(shape=[-10, -4]), "shape dimension"),
        (lambda d: chunk_of(d, "x").update(offsets=[-1, 0]), "chunk offset"),
        (lambda d: chunk_of(d, "x").update(sizes=[-10, -4]), "chunk size"),
        (lambda d: chunk_of(d, "x").update(begin=-1), "chunk begin"),
        (lambda d: chunk_of(d, "x").update(end=-1), "chunk end"),
        (lambda d: chunk_of(d, "x").update(sizes=[True, 4]), "chunk size"),
        (lambda d: chunk_of(d, "x").update(begin=1.5), "chunk begin"),
        (lambda d: next(iter(d["files"].values())).update(size=-1), ".size"),
        (lambda d: next(iter(d["files"].values())).update(header_bytes=-8), ".header_bytes"),
        (lambda d: d.update(world_size=0), "world_size"),
        (lambda d: d.update(world_size=-2), "world_size"),
        (lambda d: d["checksum"].update(block_bytes=0), "block_bytes"),
        (lambda d: d["checksum"].update(block_bytes=-64), "block_bytes"),
    ],
)
def test_negative_and_non_integer_numbers(ckpt: Path, change: Callable[[Doc], None], what: str) -> None:
    edit_manifest(ckpt, change)
    for read in manifest_readers(ckpt):
        raises_naming(CorruptCheckpointError, read, str(ckpt / "MANIFEST.json"), what)


def test_unknown_checksum_algorithm(ckpt: Path) -> None:
    edit_manifest(ckpt, lambda d: d["checksum"].update(algorithm="crc32"))
    for read in manifest_readers(ckpt):
        raises_naming(CorruptCheckpointError, read, str(ckpt / "MANIFEST.json"), "'crc32'")


@pytest.mark.parametrize("field", ["files", "tensors", "objects", "checksum", "save_id", "world_size"])
def test_missing_required_field(ckpt: Path, field: str) -> None:
    edit_manifest(ckpt, lambda d: d.pop(field))
    for read in manifest_readers(ckpt):
        raises_naming(CorruptCheckpointError, read, str(ckpt / "MANIFEST.json"), field)


@pytest.mark.parametrize("kind", ["evil", "Module", None, 3])
def test_unknown_object_kind(ckpt: Path, kind: Any) -> None:
    edit_manifest(ckpt, lambda d: d["objects"]["step"].update(kind=kind))
    for read in manifest_readers(ckpt):
        raises_naming(CorruptCheckpointError, read, str(ckpt / "MANIFEST.json"), "'step'", repr(kind))


def test_reference_to_missing_tensor(ckpt: Path) -> None:
    edit_manifest(ckpt, lambda d: d["objects"]["step"].update(value={"$": "tensor", "ref": "nowhere"}))
    for read in manifest_readers(ckpt):
        raises_naming(CorruptCheckpointError, read, str(ckpt / "MANIFEST.json"), "'step'", "'nowhere'")


def test_unknown_value_tag_refused_on_load(ckpt: Path) -> None:
    edit_manifest(ckpt, lambda d: d["objects"]["step"].update(value={"$": "evil", "v": 1}))
    load_whole, load_into, _ = readers(ckpt)
    for read in (load_whole, load_into):
        raises_naming(CorruptCheckpointError, read, "step", "unknown value kind 'evil'")


class _Payload:
    """Unpickling this calls ``os.mkdir(marker)``: what a hostile pickle would do, harmlessly."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.marker),))


def test_manifest_claiming_a_pickle_payload(ckpt: Path) -> None:
    import base64

    marker = ckpt.parent / "pwned"
    node = {"$": "pickle", "b64": base64.b64encode(pickle.dumps(_Payload(marker))).decode()}
    edit_manifest(ckpt, lambda d: d["objects"]["step"].update(value=node))
    load_whole, load_into, _ = readers(ckpt)
    for read in (load_whole, load_into):
        raises_naming(CorruptCheckpointError, read, "step", "pickled value", "allow_pickle=True")
    assert not marker.exists()
    # Opting in runs whatever the file's author chose: that is why it takes an explicit flag.
    assert shardsafe.load(ckpt, allow_pickle=True)["step"] is None
    assert marker.is_dir()


# ------------------------------------------------------------------------- not committed


def test_uncommitted_save_is_not_a_checkpoint(ckpt: Path) -> None:
    (ckpt / "MANIFEST.json").unlink()
    for read in manifest_readers(ckpt):
        msg = raises_naming(CheckpointNotFoundError, read, str(ckpt), "uncommitted")
        assert "MANIFEST.json" in msg


def test_staging_directory_is_not_a_checkpoint(ckpt: Path) -> None:
    staging = ckpt.parent / ".ckpt.staging-123"
    staging.mkdir()
    os.rename(data_file(ckpt), staging / data_file(ckpt).name)
    for read in manifest_readers(staging):
        raises_naming(CheckpointNotFoundError, read, str(staging), "uncommitted")


@pytest.mark.parametrize("what", ["nonexistent", "empty directory"])
def test_no_checkpoint(tmp_path: Path, what: str) -> None:
    path = tmp_path / "nothing"
    if what == "empty directory":
        path.mkdir()
    for read in manifest_readers(path):
        raises_naming(CheckpointNotFoundError, read, str(path), "no checkpoint")
    with pytest.raises(FileNotFoundError):  # also the builtin it refines
        shardsafe.load(path)


# ------------------------------------------------------------- known gaps, fixed by the engine


def test_overlapping_chunks_rejected(ckpt: Path) -> None:
    raw = data_file(ckpt).read_bytes()

    def change(d: Doc) -> None:
        c = chunk_of(d, "x")
        lo = c["begin"]
        sums = [xxhash.xxh3_64_hexdigest(raw[a : min(a + BLOCK, lo + 80)]) for a in (lo, lo + BLOCK)]
        half = {**c, "sizes": [5, 4], "end": lo + 80, "checksums": sums}  # rows 0..4, with valid checksums
        d["tensors"]["x"]["chunks"] = [half, dict(half)]  # twice: 40 elements, but rows 5..9 never read

    edit_manifest(ckpt, change)
    raises_naming(CorruptCheckpointError, lambda: shardsafe.load(ckpt), str(ckpt / "MANIFEST.json"), "'x'")


def test_huge_consistent_manifest_rejected_before_allocating(ckpt: Path) -> None:
    def change(d: Doc) -> None:
        d["checksum"]["block_bytes"] = 2**50  # keeps the checksum list short
        d["tensors"]["x"]["shape"] = [2**24, 2**24]  # 2^50 bytes of float32: within the 2^62 sanity cap
        c = chunk_of(d, "x")
        c["sizes"] = [2**24, 2**24]
        c["end"] = c["begin"] + 2**50
        c["checksums"] = ["0" * 16]
        d["files"][c["file"]]["size"] = c["end"]

    edit_manifest(ckpt, change)
    raises_naming(CorruptCheckpointError, lambda: shardsafe.load(ckpt), str(data_file(ckpt)))


def test_unknown_value_tag_refused_by_verify(ckpt: Path) -> None:
    edit_manifest(ckpt, lambda d: d["objects"]["step"].update(value={"$": "evil", "v": 1}))
    raises_naming(CorruptCheckpointError, lambda: shardsafe.verify(ckpt), str(ckpt / "MANIFEST.json"), "'evil'")


def test_value_errors_name_the_manifest(ckpt: Path) -> None:
    edit_manifest(ckpt, lambda d: d["objects"]["step"].update(value={"$": "evil", "v": 1}))
    raises_naming(CorruptCheckpointError, lambda: shardsafe.load(ckpt), str(ckpt / "MANIFEST.json"), "step")


def test_path_that_is_a_file(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("not a checkpoint")
    raises_naming(CheckpointNotFoundError, lambda: shardsafe.load(path), str(path))
