"""Building blocks for hostile checkpoints (tests/test_hostile.py and the fuzz test): a small state
with every kind of entry, crafted manifests re-sealed the way a hostile author would, raw JSON
fragments spliced in where ``json.dumps`` would itself recurse too deep, and safetensors headers
rewritten with their checksum, length and byte ranges made consistent again."""

from __future__ import annotations

import itertools
import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

import shardsafe
from shardsafe.engine.plan import PendingChunk
from shardsafe.format.datafile import write_file
from shardsafe.format.manifest import SELF_CHECKSUM, seal_manifest

Doc = dict[str, Any]
BLOCK = 64  # checksum block: tensor "x" (160 bytes) spans three blocks
PLACEHOLDER = "@@RAW@@"


def make_state() -> dict[str, Any]:
    """A module, an optimizer with state, a scheduler, a sharded-looking tensor, an empty tensor and
    plain values of every typed-JSON kind."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.copy_(torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7)
        model.bias.copy_(torch.tensor([0.5, -0.5, 2.0]))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    values = {
        "lr": 0.1,
        "betas": (0.9, 0.999),
        "best": float("inf"),
        3: b"\x00\x01",
        "size": torch.Size([2, 3]),
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "np": np.float32(0.25),
        "u": np.uint8(200),
        "flag": np.bool_(True),
        "nested": [{"a": [1, 2, (3, None)]}, "s"],
    }
    return {
        "model": model,
        "optim": opt,
        "sched": sched,
        "x": torch.arange(40, dtype=torch.float32).reshape(10, 4),
        "empty": torch.zeros(0, 3),
        "arr": np.arange(6, dtype=np.int16).reshape(2, 3),
        "step": 7,
        "values": values,
    }


def fresh_state() -> dict[str, Any]:
    """A state of the same structure as :func:`make_state`, with different contents (what a resuming
    job builds before loading)."""
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    return {
        "model": model,
        "optim": opt,
        "sched": sched,
        "x": torch.full((10, 4), -1.0),
        "empty": torch.zeros(0, 3),
        "step": 0,
        "values": None,
    }


def save_base(path: Path, base: Path | None = None) -> None:
    """The fuzz and hostile tests' checkpoint of :func:`make_state`; with ``base``, an incremental save
    that refers to ``base`` (a sibling) for every chunk it holds unchanged."""
    old = os.environ.get("SHARDSAFE_CHECKSUM_BLOCK_BYTES")
    os.environ["SHARDSAFE_CHECKSUM_BLOCK_BYTES"] = str(BLOCK)
    try:
        shardsafe.save(path, make_state(), metadata={"step": 7, "note": ("a", 1.5)}, base=base)
    finally:
        if old is None:
            del os.environ["SHARDSAFE_CHECKSUM_BLOCK_BYTES"]
        else:
            os.environ["SHARDSAFE_CHECKSUM_BLOCK_BYTES"] = old


def manifest_of(path: Path) -> Doc:
    doc: Doc = json.loads((path / "MANIFEST.json").read_bytes())
    return doc


def write_manifest(path: Path, doc: Doc) -> None:
    """Write ``doc`` re-sealed: its self-checksum made right again, as a hostile author would."""
    (path / "MANIFEST.json").write_text(json.dumps(seal_manifest(doc), separators=(",", ":")))


def edit_manifest(path: Path, change: Callable[[Doc], None]) -> None:
    doc = manifest_of(path)
    change(doc)
    write_manifest(path, doc)


def write_raw_manifest(path: Path, doc: Doc, fragment: str) -> None:
    """Write ``doc`` sealed, with every ``PLACEHOLDER`` string replaced by the raw JSON ``fragment``
    (canonical form: no spaces), so a nesting too deep for ``json.dumps`` still carries a valid seal."""
    body = {k: v for k, v in doc.items() if k != SELF_CHECKSUM}
    quoted = json.dumps(PLACEHOLDER)
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    digest = xxhash.xxh3_64_hexdigest(canonical.replace(quoted, fragment).encode())
    text = json.dumps({**body, SELF_CHECKSUM: digest}, separators=(",", ":"))
    (path / "MANIFEST.json").write_text(text.replace(quoted, fragment))


def deep_list(depth: int) -> str:
    return "[" * depth + "]" * depth


def data_files(path: Path) -> list[str]:
    return sorted(manifest_of(path)["files"])


def chunk_of(doc: Doc, tensor: str, i: int = 0) -> Doc:
    chunk: Doc = doc["tensors"][tensor]["chunks"][i]
    return chunk


def header_of(path: Path, name: str) -> tuple[bytes, int]:
    """The header JSON text (padding included) of data file ``name`` and the data region's start."""
    raw = (path / name).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return raw[8 : 8 + n], 8 + n


def rewrite_header(path: Path, name: str, text: bytes, *, pad: bool = True) -> None:
    """Give data file ``name`` the header JSON ``text`` (padded with spaces to a multiple of 8 unless
    ``pad`` is false) and make the manifest agree: header checksum, header length, file size and every
    chunk's byte range moved with the data region. Re-sealed."""
    raw = (path / name).read_bytes()
    _, start = header_of(path, name)
    if pad:
        text += b" " * (-(len(text) + 8) % 8)
    header = struct.pack("<Q", len(text)) + text
    (path / name).write_bytes(header + raw[start:])
    shift = len(header) - start

    def change(doc: Doc) -> None:
        entry = doc["files"][name]
        entry.update(
            header_bytes=len(header), header_checksum=xxhash.xxh3_64_hexdigest(header), size=entry["size"] + shift
        )
        for t in doc["tensors"].values():
            for c in t.get("chunks", []) if isinstance(t, dict) else []:  # (a ruled tensor lists none)
                if isinstance(c, dict) and c.get("file") == name:
                    c["begin"] += shift
                    c["end"] += shift

    edit_manifest(path, change)


def edit_header(path: Path, name: str, change: Callable[[Doc], None]) -> None:
    text, _ = header_of(path, name)
    header: Doc = json.loads(text)
    change(header)
    rewrite_header(path, name, json.dumps(header, separators=(",", ":")).encode())


def as_version(path: Path, version: int) -> None:
    """Rewrite the manifest of the (single-process, v3) checkpoint at ``path`` as a version-``version``
    writer (1 or 2) wrote it: no ``meshes``, ``side_files`` nor ``index_checksum`` (its data files, which hold no ruled
    chunk, are laid out as in v2); for version 1 also no ``refs`` nor chunk ``digest``/``ref``."""
    doc = manifest_of(path)
    assert not doc["meshes"] and all(f["index_checksum"] is None for f in doc["files"].values())
    assert not doc["side_files"], "side files exist from version 3 on"
    doc["format_version"] = version
    del doc["meshes"], doc["side_files"]
    for entry in doc["files"].values():
        del entry["index_checksum"]
    for ref in doc.get("refs", {}).values():
        for entry in ref["files"].values():
            entry.pop("index_checksum", None)
    if version == 1:
        del doc["refs"]
        for t in doc["tensors"].values():
            for c in t["chunks"]:
                del c["digest"], c["ref"]
    write_manifest(path, doc)


class _Bytes:
    """An in-memory :class:`~shardsafe.storage.base.Writer`."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: memoryview) -> None:
        self.data += data

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass


def reshard(path: Path, tensor: str, rows: list[int]) -> None:
    """Rewrite ``tensor`` (saved whole) as row ranges starting at ``rows`` (e.g. ``[0, 3, 7]``), each in
    a data file of its own, as a multi-rank save would have written it. The result is a valid
    checkpoint: it loads and verifies."""
    whole = shardsafe.load(path)
    (old,) = {c["file"] for c in manifest_of(path)["tensors"][tensor]["chunks"]}
    edit_header(path, old, lambda header: header.pop(tensor))  # its bytes stay, unreferenced
    doc = manifest_of(path)
    value = whole[tensor.split("/")[0]]
    for part in tensor.split("/")[1:]:
        value = value[part]
    assert isinstance(value, torch.Tensor)
    entry = doc["tensors"][tensor]
    chunks = []
    bounds = [*rows, value.shape[0]]
    for i, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        name = f"data-{90 + i:05d}-{doc['save_id']}.safetensors"
        offsets = (lo, *([0] * (value.dim() - 1)))
        pending = PendingChunk(tensor, offsets, tuple(value[lo:hi].shape), value[lo:hi].contiguous())
        record: Doc = {}
        _write(path, doc, name, [pending], doc["checksum"]["block_bytes"], [record])
        chunks.append(record)
    entry["chunks"] = chunks
    write_manifest(path, doc)


def _write(
    path: Path, doc: Doc, name: str, chunks: list[PendingChunk], block: int, records: list[Doc], ruled: int = 0
) -> None:
    """Write data file ``name`` of ``chunks`` (the last ``ruled`` of them in its ruled region, format v3),
    and update its ``files`` entry in ``doc`` and ``records`` (the first chunks' records, in place) to
    match."""
    out = _Bytes()
    fentry, written = write_file(out, name, chunks, block, lambda: None, ruled=ruled)
    (path / name).write_bytes(bytes(out.data))
    doc["files"][name] = {
        "size": fentry.size,
        "header_bytes": fentry.header_bytes,
        "header_checksum": fentry.header_checksum,
        "index_checksum": fentry.index_checksum,
    }
    for record, r in zip(records, written[: len(records)], strict=True):
        record.clear()
        record.update(r.to_json())


def all_tensors(value: Any, prefix: str = "") -> dict[str, bytes]:
    """Every tensor (and numpy array) in a loaded value, by path, as raw bytes with dtype and shape."""
    out: dict[str, bytes] = {}
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        out[prefix] = repr((t.dtype, tuple(t.shape))).encode() + t.reshape(-1).view(torch.uint8).numpy().tobytes()
    elif isinstance(value, np.ndarray):
        out[prefix] = repr((value.dtype.str, value.shape)).encode() + np.ascontiguousarray(value).tobytes()
    elif isinstance(value, dict):
        for k, v in value.items():
            out.update(all_tensors(v, f"{prefix}/{k}"))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            out.update(all_tensors(v, f"{prefix}/{i}"))
    return out


def state_snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """Everything a load could change in a state built by :func:`fresh_state`, copied: module and
    optimizer state dicts, scheduler state, tensors, plain values, object identities."""
    model, opt, sched = state["model"], state["optim"], state["sched"]
    snap = {
        "ids": {k: id(v) for k, v in state.items()},
        "keys": sorted(state),
        "model": all_tensors(dict(model.state_dict())),
        "optim": all_tensors(opt.state_dict()["state"]) | {"groups": repr(_groups(opt)).encode()},
        "sched": repr(sorted(sched.state_dict().items())),
        "tensors": all_tensors({k: v for k, v in state.items() if isinstance(v, torch.Tensor)}),
        "values": repr({k: v for k, v in state.items() if k in ("step", "values")}),
    }
    return snap


def _groups(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.state_dict()["param_groups"]]
