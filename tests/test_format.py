"""Format v3 pinned byte for byte (docs/format.md): the data file of a fixed state (its index
included), the manifest's structure, safetensors compatibility, header padding, and rejection of
unknown format versions; a version-2 checkpoint, pinned byte for byte as v2 wrote it, still loads
and verifies."""

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


# The safetensors header of the golden state's data file: chunks largest first, then by name; then
# (v3) the index: each chunk's xxh3-128 digest and xxh3-64 block checksums, in header order.
GOLDEN_HEADER_JSON = (
    '{"__metadata__":{"format":"pt","writer":"shardsafe"},'
    '"ids":{"dtype":"I64","shape":[3],"data_offsets":[0,24]},'
    '"w":{"dtype":"F32","shape":[2,3],"data_offsets":[24,48]},'
    '"scalar":{"dtype":"F64","shape":[],"data_offsets":[48,56]},'
    '"half":{"dtype":"BF16","shape":[2],"data_offsets":[56,60]},'
    '"mask":{"dtype":"BOOL","shape":[3],"data_offsets":[60,63]},'
    '"empty":{"dtype":"F16","shape":[0,2],"data_offsets":[63,63]},'
    '"/index":{"dtype":"U8","shape":[160],"data_offsets":[63,223]}}'
)
GOLDEN_INDEX_HEX = (
    "6d979d2326c345aa9513c6e67f3449e1" "15a2b04edd911f11" "4d922029c1f42e7d"  # ids: digest, 2 blocks
    "83f0f74bd909b2e7518e85cbe3005e3f" "9cb3e6a020e85a77" "828f2476789a0e5f"  # w
    "de65b66b79a9bc9829922be751fe947c" "df606fb485b75391"  # scalar
    "973665bcc78139ec3dc9f1f1bf0e0f71" "e5fb505175d72772"  # half
    "b1a57916ac63a6bcaed946681f85b77a" "aed946681f85b77a"  # mask
    "99aa06d3014798d86001c324468d497f" "2d06800538d394c2"  # empty: one checksum, of no bytes
)  # fmt: skip
GOLDEN_SHA256 = "70bd910560469cac99ae21249089581027d03d67d8444237b2996cf802797679"
# Version 2 (what a v2 writer wrote for the same state): no index.
GOLDEN_HEADER_JSON_V2 = (
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
GOLDEN_SHA256_V2 = "23950336adb090970cae6da421bb4c22366646fd8c6fbeea18893d2e3304ac53"
DATA = "data-00000-SAVEID.safetensors"


def _chunk(
    offsets: list[int], sizes: list[int], key: str, begin: int, end: int, sums: list[str], digest: str
) -> dict[str, Any]:
    return {
        "offsets": offsets,
        "sizes": sizes,
        "file": DATA,
        "key": key,
        "begin": begin + 64,  # v3: the header is 64 bytes longer (the index entry)
        "end": end + 64,
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
            "size": 703,
            "header_bytes": 480,
            "header_checksum": "1a2ccf957dda9ae3",
            "index_checksum": "65329b326483655f",  # v3: the data file's index
        }
    },
    "refs": {},
    "meshes": [],  # v3: no tensor of one process is sharded
}


def golden_manifest_v2() -> dict[str, Any]:
    """The manifest a v2 writer wrote for the golden state (no index, no meshes)."""
    doc: dict[str, Any] = json.loads(json.dumps(GOLDEN_MANIFEST))
    doc["format_version"] = 2
    del doc["meshes"]
    doc["files"] = {DATA: {"size": 479, "header_bytes": 416, "header_checksum": "0dcdec85c175dfd7"}}
    for t in doc["tensors"].values():
        for c in t["chunks"]:
            c["begin"] -= 64
            c["end"] -= 64
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
    assert n == 472 and (8 + n) % 8 == 0
    assert raw[8 : 8 + n] == GOLDEN_HEADER_JSON.encode() + b" " * 6
    assert raw[8 + n :].hex() == GOLDEN_DATA_HEX + GOLDEN_INDEX_HEX
    assert hashlib.sha256(raw).hexdigest() == GOLDEN_SHA256


def _write_v2(path: Path) -> None:
    """The golden state's checkpoint exactly as a version-2 writer wrote it."""
    path.mkdir()
    text = GOLDEN_HEADER_JSON_V2.encode() + b" " * 4
    raw = struct.pack("<Q", len(text)) + text + bytes.fromhex(GOLDEN_DATA_HEX)
    assert hashlib.sha256(raw).hexdigest() == GOLDEN_SHA256_V2
    (path / DATA).write_bytes(raw)
    doc = golden_manifest_v2()
    doc["created"] = 1795466248.5
    doc["library"] = {"shardsafe": "0.1.0", "torch": "2.13.0"}
    (path / "MANIFEST.json").write_text(json.dumps(seal_manifest(doc), separators=(",", ":")))


def test_version_2_checkpoint_loads_and_verifies(tmp_path: Path) -> None:
    """A v2 checkpoint (no data file index, no meshes) reads as it always did, into a state and whole."""
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


def test_checksums_partition_every_byte(golden: Path) -> None:
    """Header checksum + per-block chunk checksums + (v3) the index checksum cover each byte of the
    data file exactly once."""
    doc = json.loads((golden / "MANIFEST.json").read_text())
    block = doc["checksum"]["block_bytes"]
    ((name, entry),) = doc["files"].items()
    raw = (golden / name).read_bytes()
    assert len(raw) == entry["size"]
    assert xxhash.xxh3_64_hexdigest(raw[: entry["header_bytes"]]) == entry["header_checksum"]
    covered = [0] * len(raw)
    covered[: entry["header_bytes"]] = [1] * entry["header_bytes"]
    index = entry["size"] - 160  # the index ends the file
    assert xxhash.xxh3_64_hexdigest(raw[index:]) == entry["index_checksum"]
    covered[index:] = [1] * 160
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
    assert (summary.files, summary.tensors, summary.bytes) == (1, 6, 703)


def test_data_files_open_with_safetensors(golden: Path) -> None:
    doc = json.loads((golden / "MANIFEST.json").read_text())
    state = golden_state()
    (data,) = _data_files(golden)
    with safe_open(str(data), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "writer": "shardsafe"}
        assert sorted(f.keys()) == sorted([*doc["tensors"], "/index"])  # v3: the index is a U8 tensor
        assert f.get_tensor("/index").numpy().tobytes().hex() == GOLDEN_INDEX_HEX
        for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            if name == "/index":
                continue
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
        assert sorted(f.keys()) == ["/index", "b", "layer/w", "layer/w@2,0"]
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
    assert raw[8:250].decode() == shown_header and raw[250:256] == b" " * 6
    index = "4533ce61c4655ba3c3e077b25dd1d7694de8d78f7134f4b7095a758a27aedeaebb2dc4509829ae49c98dd7ed5d5dfd9b"
    assert raw[256:].hex() == "0000803f000000400000003f" + index
