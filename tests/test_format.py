"""Format v3 pinned byte for byte (docs/format.md): the data file of a fixed state, the manifest's
structure, safetensors compatibility, header padding, and rejection of unknown format versions; a
data file holding ruled chunks (its region and index); a version-2 checkpoint, pinned byte for byte
as v2 wrote it, still loads and verifies."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from safetensors import safe_open

import shardsafe
from shardsafe.engine.plan import PendingChunk
from shardsafe.format.datafile import build_header, write_file
from shardsafe.format.manifest import parse_manifest, seal_manifest
from shardsafe.storage.local import LocalWriter


def golden_state() -> dict[str, Any]:
    return {
        "w": torch.tensor([[1.0, -2.0, 0.5], [3.25, 0.0, -0.0]], dtype=torch.float32),
        "ids": torch.tensor([1, -2, 3], dtype=torch.int64),
        "half": torch.tensor([1.5, -1.0], dtype=torch.bfloat16),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 2, dtype=torch.float16),
        "step": 7,
    }


# The safetensors header of the golden state's data file: chunks largest first, then by name.
GOLDEN_HEADER_JSON = (
    '{"__metadata__":{"format":"pt","writer":"shardsafe"},'
    '"ids":{"dtype":"I64","shape":[3],"data_offsets":[0,24]},'
    '"w":{"dtype":"F32","shape":[2,3],"data_offsets":[24,48]},'
    '"scalar":{"dtype":"F64","shape":[],"data_offsets":[48,56]},'
    '"half":{"dtype":"BF16","shape":[2],"data_offsets":[56,60]},'
    '"mask":{"dtype":"BOOL","shape":[3],"data_offsets":[60,63]},'
    '"empty":{"dtype":"F16","shape":[0,2],"data_offsets":[63,63]}}'
)
GOLDEN_DATA_HEX = (
    "0100000000000000feffffffffffffff0300000000000000"  # ids: int64 1, -2, 3
    "0000803f000000c00000003f000050400000000000000080"  # w: float32 1, -2, 0.5, 3.25, 0, -0
    "0000000000000440"  # scalar: float64 2.5
    "c03f80bf"  # half: bfloat16 1.5, -1
    "010001"  # mask: True, False, True
)
GOLDEN_SHA256 = "23950336adb090970cae6da421bb4c22366646fd8c6fbeea18893d2e3304ac53"
DATA = "data-00000-SAVEID.safetensors"


def _chunk(
    offsets: list[int], sizes: list[int], key: str, begin: int, end: int, sums: list[str], digest: str
) -> dict[str, Any]:
    return {
        "offsets": offsets,
        "sizes": sizes,
        "file": DATA,
        "key": key,
        "begin": begin,
        "end": end,
        "checksums": sums,
        "digest": digest,  # format v2: xxh3-128 of the chunk's bytes
        "ref": None,  # format v2: stored in this checkpoint, not in a sibling
    }


GOLDEN_MANIFEST = {
    "format_version": 3,
    "save_id": "SAVEID",
    "created": "CREATED",
    "world_size": 1,
    "strategy": "plain",
    "library": {"shardsafe": "VERSION", "torch": "VERSION"},
    "checksum": {"algorithm": "xxh3-64", "block_bytes": 16},
    "metadata": {"$": "dict", "items": [["step", 7]]},
    "objects": {
        **{k: {"kind": "value", "value": {"$": "tensor", "ref": k}} for k in ("w", "ids", "half", "mask", "scalar")},
        "empty": {"kind": "value", "value": {"$": "tensor", "ref": "empty"}},
        "step": {"kind": "value", "value": 7},
    },
    "tensors": {
        "w": {
            "dtype": "float32",
            "shape": [2, 3],
            "chunks": [
                _chunk(
                    [0, 0],
                    [2, 3],
                    "w",
                    440,
                    464,
                    ["9cb3e6a020e85a77", "828f2476789a0e5f"],
                    "83f0f74bd909b2e7518e85cbe3005e3f",
                )
            ],
        },
        "ids": {
            "dtype": "int64",
            "shape": [3],
            "chunks": [
                _chunk(
                    [0],
                    [3],
                    "ids",
                    416,
                    440,
                    ["15a2b04edd911f11", "4d922029c1f42e7d"],
                    "6d979d2326c345aa9513c6e67f3449e1",
                )
            ],
        },
        "half": {
            "dtype": "bfloat16",
            "shape": [2],
            "chunks": [_chunk([0], [2], "half", 472, 476, ["e5fb505175d72772"], "973665bcc78139ec3dc9f1f1bf0e0f71")],
        },
        "mask": {
            "dtype": "bool",
            "shape": [3],
            "chunks": [_chunk([0], [3], "mask", 476, 479, ["aed946681f85b77a"], "b1a57916ac63a6bcaed946681f85b77a")],
        },
        "scalar": {
            "dtype": "float64",
            "shape": [],
            "chunks": [_chunk([], [], "scalar", 464, 472, ["df606fb485b75391"], "de65b66b79a9bc9829922be751fe947c")],
        },
        "empty": {
            "dtype": "float16",
            "shape": [0, 2],
            "chunks": [
                _chunk([0, 0], [0, 2], "empty", 479, 479, ["2d06800538d394c2"], "99aa06d3014798d86001c324468d497f")
            ],
        },
    },
    "files": {
        DATA: {
            "size": 479,
            "header_bytes": 416,
            "header_checksum": "0dcdec85c175dfd7",
            "index_checksum": None,  # v3: the file holds no ruled chunk, so it has no index
        }
    },
    "refs": {},
    "meshes": [],  # v3: no tensor of one process is sharded
    "side_files": {},  # v3: no side file
}


def golden_manifest_v2() -> dict[str, Any]:
    """The manifest a v2 writer wrote for the golden state (no index checksum, no meshes, no side files)."""
    doc: dict[str, Any] = json.loads(json.dumps(GOLDEN_MANIFEST))
    doc["format_version"] = 2
    del doc["meshes"], doc["side_files"], doc["files"][DATA]["index_checksum"]
    return doc


@pytest.fixture
def golden(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The golden state saved in this process with 16-byte checksum blocks (so chunks span blocks)."""
    monkeypatch.setenv("SHARDSAFE_CHECKSUM_BLOCK_BYTES", "16")
    path = tmp_path / "ckpt"
    shardsafe.save(path, golden_state(), metadata={"step": 7})
    return path


def _data_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.name.endswith(".safetensors"))


def test_golden_data_file_bytes(golden: Path) -> None:
    (data,) = _data_files(golden)
    raw = data.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n == 408 and (8 + n) % 8 == 0
    assert raw[8 : 8 + n] == GOLDEN_HEADER_JSON.encode() + b" " * 4
    assert raw[8 + n :].hex() == GOLDEN_DATA_HEX
    assert hashlib.sha256(raw).hexdigest() == GOLDEN_SHA256


def test_golden_manifest_structure(golden: Path) -> None:
    text = (golden / "MANIFEST.json").read_text()
    doc = json.loads(text)
    save_id = doc["save_id"]
    assert isinstance(save_id, str) and save_id
    (data,) = _data_files(golden)
    assert data.name == f"data-00000-{save_id}.safetensors"
    assert isinstance(doc["created"], float) and abs(doc["created"] - os.stat(golden / "MANIFEST.json").st_mtime) < 3600
    assert doc["library"] == {"shardsafe": shardsafe.__version__, "torch": torch.__version__.split("+")[0]}
    masked = json.loads(text.replace(save_id, "SAVEID"))
    masked["created"] = "CREATED"
    masked["library"] = {k: "VERSION" for k in masked["library"]}
    assert isinstance(masked.pop("manifest_checksum"), str)  # depends on save id and time; checked on read
    assert masked == GOLDEN_MANIFEST
    assert list(masked) == list(GOLDEN_MANIFEST)  # field order is part of the format
    assert "NaN" not in text and "Infinity" not in text
    assert sorted(os.listdir(golden)) == ["MANIFEST.json", data.name]


def _write_v2(path: Path) -> None:
    """The golden state's checkpoint exactly as a version-2 writer wrote it (the same data file bytes)."""
    path.mkdir()
    raw = struct.pack("<Q", 408) + GOLDEN_HEADER_JSON.encode() + b" " * 4 + bytes.fromhex(GOLDEN_DATA_HEX)
    assert hashlib.sha256(raw).hexdigest() == GOLDEN_SHA256
    (path / DATA).write_bytes(raw)
    doc = golden_manifest_v2()
    doc["created"] = 1795466248.5
    doc["library"] = {"shardsafe": "0.1.0", "torch": "2.13.0"}
    (path / "MANIFEST.json").write_text(json.dumps(seal_manifest(doc), separators=(",", ":")))


def test_version_2_checkpoint_loads_and_verifies(tmp_path: Path) -> None:
    """A v2 checkpoint (no meshes, no index checksums) reads as it always did, into a state and whole."""
    path = tmp_path / "v2"
    _write_v2(path)
    out = shardsafe.load(path)
    state = golden_state()
    for key, want in state.items():
        if isinstance(want, torch.Tensor):
            assert out[key].dtype == want.dtype and torch.equal(_bits(out[key]), _bits(want))
        else:
            assert out[key] == want
    dest = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    shardsafe.load(path, dest)
    assert all(torch.equal(_bits(dest[k]), _bits(v)) for k, v in state.items() if isinstance(v, torch.Tensor))
    summary = shardsafe.verify(path)
    assert (summary.files, summary.tensors, summary.bytes) == (1, 6, 479)
    info = shardsafe.inspect(path)
    assert info.format_version == 2 and info.total_bytes == 479


def test_checksums_partition_every_byte(golden: Path) -> None:
    """Header checksum + per-block chunk checksums cover each byte of the data file exactly once."""
    doc = json.loads((golden / "MANIFEST.json").read_text())
    block = doc["checksum"]["block_bytes"]
    ((name, entry),) = doc["files"].items()
    raw = (golden / name).read_bytes()
    assert len(raw) == entry["size"]
    assert xxhash.xxh3_64_hexdigest(raw[: entry["header_bytes"]]) == entry["header_checksum"]
    covered = [0] * len(raw)
    covered[: entry["header_bytes"]] = [1] * entry["header_bytes"]
    for t in doc["tensors"].values():
        for c in t["chunks"]:
            starts = list(range(c["begin"], c["end"], block)) or [c["begin"]]
            assert len(c["checksums"]) == len(starts)
            for k, lo in enumerate(starts):
                hi = min(lo + block, c["end"])
                assert xxhash.xxh3_64_hexdigest(raw[lo:hi]) == c["checksums"][k]
                for i in range(lo, hi):
                    covered[i] += 1
    assert covered == [1] * len(raw)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def test_golden_round_trip_and_verify(golden: Path) -> None:
    out = shardsafe.load(golden)
    for key, want in golden_state().items():
        if isinstance(want, torch.Tensor):
            assert out[key].dtype == want.dtype and out[key].shape == want.shape
            assert torch.equal(_bits(out[key]), _bits(want))  # bit for bit: -0.0 stays -0.0
        else:
            assert out[key] == want
    assert math.copysign(1.0, float(out["w"][1, 2])) == -1.0
    summary = shardsafe.verify(golden)
    assert (summary.files, summary.tensors, summary.bytes) == (1, 6, 479)


def test_data_files_open_with_safetensors(golden: Path) -> None:
    doc = json.loads((golden / "MANIFEST.json").read_text())
    state = golden_state()
    (data,) = _data_files(golden)
    with safe_open(str(data), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "writer": "shardsafe"}
        assert sorted(f.keys()) == sorted(doc["tensors"])
        for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            got = f.get_tensor(name)
            assert got.dtype == state[name].dtype and got.shape == state[name].shape
            assert torch.equal(got, state[name])


def test_chunked_file_opens_with_safetensors(tmp_path: Path) -> None:
    """Shards of a tensor (nonzero offsets) appear to safetensors as ``name@offsets`` keys, and the chunk
    records locate exactly their bytes."""
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    chunks = [
        PendingChunk("layer/w", (0, 0), (2, 4), full[0:2].contiguous()),
        PendingChunk("layer/w", (2, 0), (4, 4), full[2:6].contiguous()),
        PendingChunk("b", (0,), (3,), torch.tensor([7, 8, 9], dtype=torch.int32)),
    ]
    path = tmp_path / "data-00003-abc.safetensors"
    firsts: list[int] = []
    writer = LocalWriter(str(path))
    entry, records = write_file(writer, path.name, chunks, 32, lambda: firsts.append(1))
    writer.close()
    raw = path.read_bytes()
    assert firsts == [1]
    assert entry.size == len(raw) and entry.header_bytes % 8 == 0
    assert entry.header_checksum == xxhash.xxh3_64_hexdigest(raw[: entry.header_bytes])
    assert [r.key for r in records] == ["layer/w", "layer/w@2,0", "b"]
    assert [len(r.checksums) for r in records] == [1, 2, 1]  # 32, 64 and 12 bytes in 32-byte blocks
    with safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == ["b", "layer/w", "layer/w@2,0"]
        for c, r in zip(chunks, records, strict=True):
            assert torch.equal(f.get_tensor(r.key), c.data)
            assert raw[r.begin : r.end] == c.data.numpy().tobytes()


@pytest.mark.parametrize("name_len", range(1, 17))
def test_build_header_pads_to_eight_bytes(name_len: int) -> None:
    chunk = PendingChunk("n" * name_len, (0,), (3,), torch.zeros(3, dtype=torch.uint8))
    header = build_header([chunk])
    (n,) = struct.unpack("<Q", header[:8])
    assert len(header) == 8 + n and len(header) % 8 == 0
    text = header[8:].decode()
    body = text.rstrip(" ")
    assert len(text) - len(body) < 8 and set(text[len(body) :]) <= {" "}
    assert json.loads(text)["n" * name_len] == {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]}


@pytest.mark.parametrize("version", [4, 0, "1", 1.0, True, None])
def test_unknown_format_version_rejected(golden: Path, version: Any) -> None:
    manifest = golden / "MANIFEST.json"
    doc = json.loads(manifest.read_text())
    doc["format_version"] = version
    manifest.write_text(json.dumps(seal_manifest(doc)))
    with pytest.raises(shardsafe.CorruptCheckpointError, match="format_version") as err:
        shardsafe.load(golden)
    assert str(manifest) in str(err.value)
    with pytest.raises(shardsafe.CorruptCheckpointError, match="format_version"):
        shardsafe.verify(golden)
    if version == 4:
        assert "upgrade shardsafe" in str(err.value)


def test_missing_format_version_rejected() -> None:
    with pytest.raises(shardsafe.CorruptCheckpointError, match="no integer format_version"):
        parse_manifest(b'{"save_id": "x"}', "ckpt/MANIFEST.json")


def test_worked_example_in_the_spec_is_true(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/format.md section 9 shows a real manifest and data file header: they must stay what we write."""
    monkeypatch.delenv("SHARDSAFE_CHECKSUM_BLOCK_BYTES", raising=False)
    spec = (Path(__file__).parent.parent / "docs" / "format.md").read_text()
    example = spec[spec.index("## 9. Worked example") :]
    python, listing, shown_header, manifest = re.findall(r"```(?:python|json)?\n(.*?)\n```", example, re.S)[:4]
    assert "shardsafe.save" in python and "MANIFEST.json" in listing
    shown_manifest = json.loads(manifest)

    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0]]))
        model.bias.copy_(torch.tensor([0.5]))
    state = {"model": model, "step": 7, "sched": {"lr": 0.1, "betas": (0.9, 0.999), "best": float("inf")}}
    shardsafe.save(tmp_path / "step-7", state, metadata={"step": 7})

    def masked(doc: dict[str, Any]) -> dict[str, Any]:
        text = json.dumps(doc).replace(doc["save_id"], "SAVEID")
        out: dict[str, Any] = json.loads(text)
        out["created"] = out["library"] = out["manifest_checksum"] = None
        return out

    written = json.loads((tmp_path / "step-7" / "MANIFEST.json").read_text())
    assert masked(written) == masked(shown_manifest)
    (data,) = _data_files(tmp_path / "step-7")
    raw = data.read_bytes()
    assert raw[8:190].decode() == shown_header and raw[190:192] == b"  "
    assert raw[192:].hex() == "0000803f000000400000003f"


# Format v3, a checkpoint of 2 ranks whose "w" (6 x 4 float32) and "b" (4 int64) are ruled over a mesh
# of writers [0, 1] ("dims": [[0, 1]]: rows 0-2 and 0-1 on rank 0, rows 3-5 and 2-3 on rank 1) and
# whose "step" is listed (written by rank 0); checksum blocks of 16 bytes. Each file: its listed
# chunks' entries, then "/shards" (the ruled chunks in rule order: w's box, then b's), then "/index"
# (their block checksums: w's 48 bytes make 3 blocks, b's 16 bytes 1).
RULED_HEADERS = {
    0: '{"__metadata__":{"format":"pt","writer":"shardsafe"},'
    '"step":{"dtype":"F32","shape":[],"data_offsets":[0,4]},'
    '"/shards":{"dtype":"U8","shape":[64],"data_offsets":[4,68]},'
    '"/index":{"dtype":"U8","shape":[32],"data_offsets":[68,100]}}',
    1: '{"__metadata__":{"format":"pt","writer":"shardsafe"},'
    '"/shards":{"dtype":"U8","shape":[64],"data_offsets":[0,64]},'
    '"/index":{"dtype":"U8","shape":[32],"data_offsets":[64,96]}}',
}
RULED_INDEX_HEX = {
    0: "0aee2086d517557e" "71a08ac2ec730b43" "4cd842368f6fff4f" "907c0e2051ca2104",
    1: "3c65b83e8acdeca0" "1059d8df74150a21" "c2c44ea073af1370" "df36c43410b9baa0",
}  # fmt: skip
RULED_SHA256 = {
    0: "a49d6360112af0a62a96cb74ecd1528e0be400e5f480b0ad3a34fb84269b115e",
    1: "8749e4e58596401491fd74a76014f8c4b5dcda1c9f43de467ca3628683f8f3fc",
}
RULED_FILES = {
    0: {"size": 340, "header_bytes": 240, "header_checksum": "3f1fac950b5d098a", "index_checksum": "e85f720d73777953"},
    1: {"size": 280, "header_bytes": 184, "header_checksum": "7ed3614445d5e71e", "index_checksum": "8e4663705f43f476"},
}


def _ruled_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """Write the ruled golden checkpoint at ``path``: its data files as the writer lays them out, and
    its manifest; the tensors it holds."""
    w = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    b = torch.tensor([5, -6, 7, 8], dtype=torch.int64)
    step = torch.tensor(7.0)
    path.mkdir()
    files: dict[int, list[PendingChunk]] = {
        0: [
            PendingChunk("step", (), (), step),
            PendingChunk("w", (0, 0), (3, 4), w[0:3].contiguous()),
            PendingChunk("b", (0,), (2,), b[0:2].contiguous()),
        ],
        1: [PendingChunk("w", (3, 0), (3, 4), w[3:6].contiguous()), PendingChunk("b", (2,), (2,), b[2:4].contiguous())],
    }
    step_record: dict[str, Any] = {}
    for rank, chunks in files.items():
        name = f"data-{rank:05d}-SAVEID.safetensors"
        writer = LocalWriter(str(path / name))
        entry, records = write_file(writer, name, chunks, 16, lambda: None, ruled=2)
        writer.close()
        assert vars(entry) == RULED_FILES[rank]
        if rank == 0:
            step_record = records[0].to_json()
    rule = {"mesh": 0, "dims": [[0, 1]]}
    doc = {
        "format_version": 3,
        "save_id": "SAVEID",
        "created": 1795466248.5,
        "world_size": 2,
        "strategy": "fsdp",
        "library": {"shardsafe": "0.1.0", "torch": "2.13.0"},
        "checksum": {"algorithm": "xxh3-64", "block_bytes": 16},
        "metadata": None,
        "objects": {k: {"kind": "value", "value": {"$": "tensor", "ref": k}} for k in ("w", "b", "step")},
        "tensors": {
            "w": {"dtype": "float32", "shape": [6, 4], "sharding": rule},
            "b": {"dtype": "int64", "shape": [4], "sharding": rule},
            "step": {"dtype": "float32", "shape": [], "chunks": [step_record]},
        },
        "files": {f"data-{r:05d}-SAVEID.safetensors": RULED_FILES[r] for r in (0, 1)},
        "refs": {},
        "meshes": [{"shape": [2], "ranks": [0, 1]}],
        "side_files": {},
    }
    (path / "MANIFEST.json").write_text(json.dumps(seal_manifest(doc), separators=(",", ":")))
    return {"w": w, "b": b, "step": step}


def test_ruled_data_files_bytes(tmp_path: Path) -> None:
    """The region of ruled chunks and the index of each data file, byte for byte (docs/format.md section 2)."""
    _ruled_checkpoint(tmp_path / "c")
    for rank in (0, 1):
        raw = (tmp_path / "c" / f"data-{rank:05d}-SAVEID.safetensors").read_bytes()
        assert hashlib.sha256(raw).hexdigest() == RULED_SHA256[rank]
        (n,) = struct.unpack("<Q", raw[:8])
        assert raw[8 : 8 + n].rstrip(b" ").decode() == RULED_HEADERS[rank] and (8 + n) % 8 == 0
        assert raw[-32:].hex() == RULED_INDEX_HEX[rank]
        with safe_open(str(tmp_path / "c" / f"data-{rank:05d}-SAVEID.safetensors"), framework="pt") as f:
            assert set(f.keys()) == ({"step"} if rank == 0 else set()) | {"/shards", "/index"}


def test_ruled_checkpoint_loads_verifies_and_partitions_every_byte(tmp_path: Path) -> None:
    """The ruled golden checkpoint loads whole, verifies (every byte: headers, blocks, indexes), and
    rank 1's shard of each ruled tensor is read from rank 1's file alone."""
    want = _ruled_checkpoint(tmp_path / "c")
    out = shardsafe.load(tmp_path / "c")
    assert all(torch.equal(out[k], v) for k, v in want.items())
    summary = shardsafe.verify(tmp_path / "c")
    assert (summary.files, summary.tensors, summary.bytes) == (2, 3, 340 + 280)
    info = {e.name: e.chunks for e in shardsafe.inspect(tmp_path / "c").entries if e.kind == "tensor"}
    assert info == {"w": 2, "b": 2, "step": 1}
    from shardsafe.engine.read import chunk_source, open_manifest
    from shardsafe.storage.local import LocalStorage

    storage = LocalStorage()
    source = chunk_source(storage, str(tmp_path / "c"), open_manifest(storage, str(tmp_path / "c")))
    (chunk,) = source.chunks("w", ((3, 0), (3, 4)))
    assert (chunk.file, chunk.begin, chunk.end, chunk.checksums) == (
        "data-00001-SAVEID.safetensors",
        184,
        232,
        ("3c65b83e8acdeca0", "1059d8df74150a21", "c2c44ea073af1370"),
    )
    assert list(source.indexes) == ["data-00001-SAVEID.safetensors"]  # rank 0's file was not opened
