"""Seeded, structure-aware mutations of a checkpoint, for tests/test_fuzz.py.

Each case is a copy of a valid checkpoint (several data files, a tensor in three chunks, a module,
an optimizer, a scheduler, values of every typed-JSON kind) damaged one way:

- ``json``: one to three JSON-level edits of ``MANIFEST.json`` at any depth (replace a node with a
  value of another type or out of range, a deep nesting or a raw ``NaN``; delete, add, duplicate or
  swap members), re-sealed with ``seal_manifest`` so that the edits reach validation;
- ``header``: the same edits on a data file's safetensors header, with the header checksum, length
  and byte ranges made consistent in the manifest again, or raw header bytes (BOM, UTF-16, padding);
- ``bytes``: bit flips, truncation, appended or zeroed bytes in the manifest or a data file;
- ``fs``: a FIFO, a directory, a symlink loop, a dangling symlink, ``/dev/zero``, a symlink out of
  the checkpoint (to the right bytes) or inside it, a missing file, a sparse 500 GB file behind a
  forged shape.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

from hostile import (
    PLACEHOLDER,
    Doc,
    deep_list,
    header_of,
    manifest_of,
    rewrite_header,
    write_manifest,
    write_raw_manifest,
)
from shardsafe.format.manifest import SELF_CHECKSUM

Path_ = tuple[Any, ...]

HOSTILE_VALUES: list[Any] = [
    None, True, False, 0, 1, -1, 7, 2**31, 2**62, 2**62 + 1, 2**63, -(2**63), 10**30, 1.5, -0.0, 1e300, "", "x",
    "123", "abc", "\n", "../x", "/etc/passwd", ".hidden", "a\0b", "_inductor", "V1", "float32", "int64", "nan",
    "model/weight", "x", "data-00000-0.safetensors", "\u202e\u0007", "é" * 3, "x" * 5000, [], [0], [1, 2, 3], ["a"],
    [-1], [1.5], [[]], {}, {"$": "tuple", "items": "abc"}, {"$": "size", "v": "123"}, {"$": "size", "v": [-1]},
    {"$": "dict", "items": "ab"}, {"$": "dict", "items": [["a", 1, 2]]}, {"$": "npscalar", "dtype": "V1", "v": 0},
    {"$": "npscalar", "dtype": "uint8", "v": -1}, {"$": "npscalar", "dtype": "V50000000", "v": 0},
    {"$": "dtype", "v": "_inductor"}, {"$": "dtype", "v": "float32"}, {"$": "device", "v": "cuda:0"},
    {"$": "device", "v": "cpu\n"}, {"$": "tensor", "ref": "x"}, {"$": "tensor", "ref": "nowhere"},
    {"$": "ndarray", "ref": "arr"}, {"$": "bytes", "b64": "!!"}, {"$": "float", "v": "nan"},
    {"$": "pickle", "b64": "gASVAAAAAAAAAAA="}, {"$": "evil"}, {"$": "tensor", "ref": "x", "extra": 1},
    "..", ".", "prev", "ckpt", "../prev", "prev/..", "prev\\x", "base", "0" * 32, "f" * 32,
]  # fmt: skip
"""(The last row aims at references between siblings, format v2: names of the sibling, of the
checkpoint itself, of nothing; paths out; digests.)"""
RAW_VALUES = [
    deep_list(100_000),
    deep_list(130),
    '{"$":"tuple","items":[' * 60 + "]}" * 60,
    '{"$":"dict","items":[["a",' * 40 + "1" + "]]}" * 40,
    "NaN",
    "-Infinity",
    "1e400",
    '"\\ud800"',
]
SECTION_WEIGHTS = {"tensors": 10, "objects": 10, "files": 4, "refs": 4, "metadata": 3, "checksum": 2}
"""How often each part of a manifest is picked for an edit (others: 1): the big, deep parts most."""
KINDS = ["json"] * 10 + ["header"] * 4 + ["bytes"] * 4 + ["fs"] * 3


def nodes(doc: Any, path: Path_ = ()) -> list[Path_]:
    """Every path (tuple of keys and indices) into ``doc``, depth first, itself included."""
    out = [path]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += nodes(v, (*path, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += nodes(v, (*path, i))
    return out


def get(doc: Any, path: Path_) -> Any:
    for p in path:
        doc = doc[p]
    return doc


def mutate(rng: random.Random, doc: Any, protect: tuple[str, ...] = ()) -> tuple[Any, str, str | None]:
    """One random edit of ``doc`` at a random node: returns the new document, a description, and a
    raw JSON fragment standing for ``PLACEHOLDER`` (or None)."""
    doc = json.loads(json.dumps(doc))
    sections = [k for k in doc if k not in protect] if isinstance(doc, dict) else [None]
    section = rng.choices(sections, weights=[SECTION_WEIGHTS.get(k, 1) for k in sections])[0]
    paths = [p for p in nodes(doc) if p and (section is None or p[0] == section)] or [()]
    path = rng.choice(paths)
    parent_path, key = path[:-1], (path[-1] if path else None)
    parent = get(doc, parent_path) if path else None
    op = rng.choice(["replace"] * 5 + ["number", "string", "delete", "add", "duplicate", "swap", "raw"])
    node = get(doc, path)
    fragment = None
    if op == "number" and isinstance(node, (int, float)) and not isinstance(node, bool):
        new: Any = rng.choice([node + 1, node - 1, -node, node * 2, 0, 2**62, 2**63, 10**30, float(node) + 0.5])
    elif op == "string" and isinstance(node, str):
        new = rng.choice([node + "\n", "../" + node, "." + node, node[:-1], node.upper(), node + "\0", node * 50])
    elif op == "raw":
        new, fragment = PLACEHOLDER, rng.choice(RAW_VALUES)
    else:
        new = rng.choice(HOSTILE_VALUES)
    what = f"{op} at {list(path)[:8]}"
    if parent is None:
        return new, what + f" -> {str(new)[:40]!r}", fragment
    if op == "delete":
        del parent[key]
    elif op == "add" and isinstance(parent, dict):
        parent[rng.choice(["extra", "$", "v", "items", "ref", "sizes"])] = rng.choice(HOSTILE_VALUES)
    elif op == "add":
        parent.insert(key, rng.choice(HOSTILE_VALUES))
    elif op == "duplicate" and isinstance(parent, list):
        parent.insert(key, json.loads(json.dumps(parent[key])))
    elif op == "swap" and len(parent) > 1:
        keys = list(parent) if isinstance(parent, dict) else list(range(len(parent)))
        other = rng.choice(keys)
        parent[key], parent[other] = parent[other], parent[key]
    else:
        parent[key] = new
        return doc, what + f" -> {str(new)[:40]!r}", fragment
    return doc, what, fragment


def _copy(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        shutil.copyfile(f, dst / f.name)


def build(base: Path, case: Path, seed: int, siblings: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Create case number ``seed`` at ``case/ckpt`` from the checkpoint ``base``, with intact copies of
    the ``siblings`` it refers to (an incremental checkpoint) beside it; returns its description
    (``kind``, ``what``)."""
    rng = random.Random(seed)
    ckpt = case / "ckpt"
    _copy(base, ckpt)
    for sibling in siblings:
        _copy(sibling, case / sibling.name)
    kind = rng.choice(KINDS)
    what = {"json": _json, "header": _header, "bytes": _bytes, "fs": _fs}[kind](rng, ckpt, case)
    return {"kind": kind, "what": what}


def _json(rng: random.Random, ckpt: Path, case: Path) -> str:
    doc: Doc = manifest_of(ckpt)
    done = []
    fragment = None
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        doc, what, raw = mutate(rng, doc, protect=(SELF_CHECKSUM,))
        done.append(what)
        fragment = raw or fragment
        if raw:
            break
    if not isinstance(doc, dict):
        (ckpt / "MANIFEST.json").write_text(json.dumps(doc))
    elif fragment is not None and PLACEHOLDER in json.dumps(doc):
        write_raw_manifest(ckpt, doc, fragment)
    else:
        write_manifest(ckpt, doc)
    return "; ".join(done)


def _header(rng: random.Random, ckpt: Path, case: Path) -> str:
    name = rng.choice(sorted(manifest_of(ckpt)["files"]))
    text, _ = header_of(ckpt, name)
    body = text.rstrip(b" ")
    choice = rng.random()
    if choice < 0.7:
        header, what, fragment = mutate(rng, json.loads(body))
        raw = json.dumps(header, separators=(",", ":"))
        if fragment is not None:
            raw = raw.replace(json.dumps(PLACEHOLDER), fragment)
        rewrite_header(ckpt, name, raw.encode())
        return f"{name}: {what}"
    raw_edits = {
        "bom": b"\xef\xbb\xbf" + body,
        "utf-16": body.decode().encode("utf-16"),
        "tab padding": body + b"\t" * (-(len(body) + 8) % 8 or 8),
        "nan": body[:-1] + b',"junk":NaN}',
        "list": b"[" + body + b"]",
        "trailing comma": body[:-1] + b",}",
        "no metadata": body.replace(b'"__metadata__":{"format":"pt","writer":"shardsafe"},', b""),
        "empty": b"",
    }
    label = rng.choice(sorted(raw_edits))
    rewrite_header(ckpt, name, raw_edits[label], pad=label != "tab padding")
    return f"{name}: raw {label}"


def _target(rng: random.Random, ckpt: Path) -> str:
    files = sorted(manifest_of(ckpt)["files"])
    return rng.choice(["MANIFEST.json", *files, *files])  # data files twice as often


def _bytes(rng: random.Random, ckpt: Path, case: Path) -> str:
    name = _target(rng, ckpt)
    path = ckpt / name
    raw = bytearray(path.read_bytes())
    op = rng.choice(["flip", "flip", "flip", "truncate", "append", "zero"])
    if op == "flip":
        for _ in range(rng.choice([1, 1, 2, 8])):
            at = rng.randrange(len(raw))
            raw[at] ^= 1 << rng.randrange(8)
    elif op == "truncate":
        raw = raw[: rng.randrange(len(raw))]
    elif op == "append":
        raw += bytes(rng.randrange(256) for _ in range(rng.choice([1, 7, 100])))
    else:
        at, n = rng.randrange(len(raw)), rng.choice([1, 8, 64])
        raw[at : at + n] = bytes(len(raw[at : at + n]))
    path.write_bytes(bytes(raw))
    return f"{op} {name}"


def _fs(rng: random.Random, ckpt: Path, case: Path) -> str:
    name = _target(rng, ckpt)
    path = ckpt / name
    op = rng.choice(["fifo", "dir", "loop", "dangling", "devzero", "outside", "inside", "missing", "sparse"])
    if op == "sparse":
        return _sparse(ckpt)
    if op == "outside":
        (case / "outside").mkdir()
        os.rename(path, case / "outside" / name)
        os.symlink(case / "outside" / name, path)
        return f"{name} -> symlink out of the checkpoint"
    if op == "inside":
        (ckpt / "sub").mkdir()
        os.rename(path, ckpt / "sub" / name)
        os.symlink(os.path.join("sub", name), path)
        return f"{name} -> symlink inside"
    path.unlink()
    if op == "fifo":
        os.mkfifo(path)
    elif op == "dir":
        path.mkdir()
    elif op == "loop":
        os.symlink(name, path)
    elif op == "dangling":
        os.symlink("nowhere", path)
    elif op == "devzero":
        os.symlink("/dev/zero", path)
    return f"{name} -> {op}"


def _sparse(ckpt: Path) -> str:
    """Tensor "x"'s first chunk grown to fill a sparse 500 GB file, with one checksum block for all of
    it; the manifest and the safetensors header consistent with that."""
    doc = manifest_of(ckpt)
    c = doc["tensors"]["x"]["chunks"][0]
    rows = (500 * 2**30) // 16
    text, _ = header_of(ckpt, c["file"])
    header = json.loads(text)
    header[c["key"]] = {"dtype": "F32", "shape": [rows, 4], "data_offsets": [0, rows * 16]}
    rewrite_header(ckpt, c["file"], json.dumps(header, separators=(",", ":")).encode())
    doc = manifest_of(ckpt)
    t = doc["tensors"]["x"]
    c = t["chunks"][0]
    doc["checksum"]["block_bytes"] = 2**40
    for entry in doc["tensors"].values():
        for chunk in entry["chunks"]:
            chunk["checksums"] = chunk["checksums"][:1]
    t["shape"] = [rows + sum(ch["sizes"][0] for ch in t["chunks"][1:]), 4]
    for ch in t["chunks"][1:]:
        ch["offsets"][0] += rows - c["sizes"][0]
        ch["key"] = f"x@{ch['offsets'][0]},0"
    c["sizes"], c["end"] = [rows, 4], c["begin"] + rows * 16
    doc["files"][c["file"]]["size"] = c["end"]
    write_manifest(ckpt, doc)
    os.truncate(ckpt / c["file"], c["end"])
    return "sparse 500 GB data file behind a forged shape of 'x'"
