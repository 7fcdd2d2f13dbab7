"""Seeded mutations of a format-v3 checkpoint with ruled tensors and data file indexes, for
tests/test_fuzz_v3.py (run by tests/fuzz_child.py like tests/fuzz_cases.py's).

The base is tests/hostile.py's state saved in one process, then rewritten as a 4-rank save would
have written two of its tensors (:func:`rule_base`): ``x`` (10 x 4) split over a mesh of ranks 1, 2, 3
(rows 0-3, 4-7, 8-9), and ``optim/state/weight/exp_avg`` (3 x 4) over ranks 2, 3 with a strided split
(rank 2 holds rows 0 and 2 as two boxes); their chunks are in the ruled regions of those ranks' data
files, their checksums in the files' indexes. Each case damages it one way, in one of two families:

- ``manifest`` (v3 manifests): one to three JSON edits of the meshes, the sharding rules, the
  ruled tensors' entries and the files' ``index_checksum``, re-sealed (tests/fuzz_cases.py's
  ``mutate``, aimed there), or a rule made to claim what the files do not hold (a 2^40-coordinate
  mesh, huge split factors, ranks without files, another tensor's rule);
- ``index`` (v3 data files' ruled regions and indexes): bytes of a ruled file's index flipped, zeroed,
  truncated or appended to; or, as a hostile author would, the index rewritten (checksums swapped,
  changed, dropped, duplicated) with ``index_checksum`` made right again, the ``/shards`` or ``/index``
  header entry moved, resized, retyped, swapped, dropped or renamed, another entry added, with the
  header's checksum and length made right again; or a ruled file removed or replaced by a FIFO.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
import xxhash

import shardsafe
from fuzz_cases import mutate
from hostile import (
    PLACEHOLDER,
    Doc,
    _write,
    header_of,
    manifest_of,
    rewrite_header,
    write_manifest,
    write_raw_manifest,
)
from shardsafe.engine.plan import PendingChunk
from shardsafe.format.manifest import STORABLE_DTYPES
from shardsafe.format.sharding import Mesh, Sharding, boxes

RULES = {
    "x": ({"shape": [3], "ranks": [1, 2, 3]}, [[0, 1]]),
    "optim/state/weight/exp_avg": ({"shape": [2], "ranks": [2, 3]}, [[0, 2]]),
}
RULED_RANKS = (1, 2, 3)


def rule_base(path: Path) -> None:
    """Rewrite the one-process checkpoint at ``path`` so that the tensors of :data:`RULES` are ruled
    (module docstring): their chunks leave rank 0's file (written again without them) for the files
    of ranks 1 to 3, and the manifest says ``world_size`` 4. The result loads and verifies."""
    whole = shardsafe.load(path)
    doc = manifest_of(path)
    sid, block = doc["save_id"], doc["checksum"]["block_bytes"]

    def value(name: str) -> torch.Tensor:
        v: Any = whole[name.split("/")[0]]
        for part in name.split("/")[1:]:
            v = v[part]
        assert isinstance(v, torch.Tensor)
        return v

    (old,) = doc["files"]
    raw = (path / old).read_bytes()
    kept = []
    for name, entry in doc["tensors"].items():
        if name in RULES:
            continue
        for c in entry["chunks"]:
            dtype = STORABLE_DTYPES[entry["dtype"]]
            data = torch.empty(c["sizes"], dtype=dtype)
            if c["end"] > c["begin"]:
                data = torch.frombuffer(bytearray(raw[c["begin"] : c["end"]]), dtype=dtype).reshape(c["sizes"])
            kept.append((c, PendingChunk(name, tuple(c["offsets"]), tuple(c["sizes"]), data)))
    kept.sort(key=lambda k: k[0]["begin"])
    _write(path, doc, old, [k[1] for k in kept], block, [k[0] for k in kept])
    meshes: list[Doc] = []
    per_rank: dict[int, list[PendingChunk]] = {r: [] for r in RULED_RANKS}
    for name in [n for n in doc["tensors"] if n in RULES]:  # the file's order: tensors in manifest order
        mesh, dims = RULES[name]
        meshes.append(mesh)
        t = value(name)
        rule = Sharding(len(meshes) - 1, tuple((d, f) for d, f in dims))
        m = Mesh(tuple(mesh["shape"]), tuple(mesh["ranks"]))
        for i, rank in enumerate(m.ranks):
            for offsets, sizes in boxes(tuple(t.shape), rule, m, m.coordinate(i)):
                part = t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))].contiguous()
                per_rank[rank].append(PendingChunk(name, offsets, sizes, part))
        doc["tensors"][name] = {
            "dtype": doc["tensors"][name]["dtype"],
            "shape": list(t.shape),
            "sharding": rule.to_json(),
        }
    for rank, chunks in per_rank.items():
        _write(path, doc, f"data-{rank:05d}-{sid}.safetensors", chunks, block, [], ruled=len(chunks))
    doc["meshes"] = meshes
    doc["world_size"] = 4
    write_manifest(path, doc)


def _copy(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        shutil.copyfile(f, dst / f.name)


def build(base: Path, case: Path, seed: int) -> dict[str, Any]:
    """Case number ``seed`` at ``case/ckpt`` from the ruled checkpoint ``base``; its description
    (``kind``: what tests/fuzz_child.py needs, ``family``, ``what``)."""
    rng = random.Random(seed)
    ckpt = case / "ckpt"
    _copy(base, ckpt)
    family = "manifest" if seed % 2 else "index"
    if family == "manifest":
        kind, what = ("json", _rule_edit(rng, ckpt)) if rng.random() < 0.75 else ("json", _rule_claim(rng, ckpt))
    else:
        choice = rng.random()
        if choice < 0.35:
            kind, what = "bytes", _index_bytes(rng, ckpt)
        elif choice < 0.65:
            kind, what = "header", _index_rewrite(rng, ckpt)
        elif choice < 0.92:
            kind, what = "header", _header_entry(rng, ckpt)
        else:
            kind, what = "fs", _file(rng, ckpt)
    return {"kind": kind, "family": family, "what": what}


def _ruled_files(ckpt: Path) -> list[str]:
    return sorted(n for n in manifest_of(ckpt)["files"] if not n.startswith("data-00000-"))


def _rule_edit(rng: random.Random, ckpt: Path) -> str:
    """JSON edits aimed at the v3 parts of the manifest, re-sealed."""
    doc = manifest_of(ckpt)
    target = rng.choice(["meshes", "sharding", "sharding", "entry", "index_checksum"])
    done, fragment = [], None
    for _ in range(rng.choice([1, 1, 2, 3])):
        if target == "meshes":
            sub, what, raw = mutate(rng, doc["meshes"])
            doc["meshes"] = sub
        elif target in ("sharding", "entry"):
            name = rng.choice(sorted(RULES))
            if (
                target == "sharding"
                and isinstance(doc["tensors"].get(name), dict)
                and "sharding" in doc["tensors"][name]
            ):
                sub, what, raw = mutate(rng, doc["tensors"][name]["sharding"])
                doc["tensors"][name]["sharding"] = sub
            else:
                sub, what, raw = mutate(rng, doc["tensors"].get(name))
                doc["tensors"][name] = sub
            what = f"{name}: {what}"
        else:
            name = rng.choice(_ruled_files(ckpt))
            sub, what, raw = mutate(rng, doc["files"][name])
            doc["files"][name] = sub
            what = f"{name}: {what}"
        done.append(f"{target} {what}")
        fragment = raw or fragment
        if raw:
            break
    if fragment is not None and PLACEHOLDER in json.dumps(doc):
        write_raw_manifest(ckpt, doc, fragment)
    else:
        write_manifest(ckpt, doc)
    return "; ".join(done)


def _rule_claim(rng: random.Random, ckpt: Path) -> str:
    """A rule claiming more, or other, than the files hold, in a manifest that validates."""
    doc = manifest_of(ckpt)
    claims = {
        "2^40 coordinates": lambda: (doc.update(world_size=2**31 - 1), doc["meshes"][0].update(shape=[2**20, 2**20])),
        "2^30 writers listed lazily": lambda: doc["meshes"][0].update(shape=[2**30]),
        "a split factor of 2^16": lambda: doc["tensors"]["x"]["sharding"].update(dims=[[0, 2**16]]),
        "a split factor past the rows": lambda: doc["tensors"]["x"]["sharding"].update(dims=[[0, 7]]),
        "split along dim 1": lambda: doc["tensors"]["x"]["sharding"].update(dims=[[1, 1]]),
        "rank 0 writes x": lambda: doc["meshes"][0].update(ranks=[0, 2, 3]),
        "writers swapped": lambda: doc["meshes"][0].update(ranks=[2, 1, 3]),
        "another mesh": lambda: doc["tensors"]["x"]["sharding"].update(mesh=1, dims=[[0, 1]]),
        "the other rule": lambda: doc["tensors"]["x"].update(
            sharding=doc["tensors"]["optim/state/weight/exp_avg"]["sharding"]
        ),
        "a larger shape": lambda: doc["tensors"]["x"].update(shape=[11, 4]),
        "a smaller shape": lambda: doc["tensors"]["x"].update(shape=[9, 4]),
        "another dtype": lambda: doc["tensors"]["x"].update(dtype="float64"),
        "a 1-d shape": lambda: doc["tensors"]["x"].update(shape=[40]),
        "a huge shape": lambda: doc["tensors"]["x"].update(shape=[10 * 2**40, 4]),
        "no files for the ranks": lambda: doc["files"].pop(_ruled_files(ckpt)[0]),
        "a mesh of 4": lambda: doc["meshes"][0].update(shape=[4], ranks=[1, 2, 3, 3]),
        "a mesh of 1": lambda: doc["meshes"][0].update(shape=[1], ranks=[1]),
        "2-d mesh": lambda: (
            doc["meshes"][0].update(shape=[3, 1], ranks=[1, 2, 3]),
            doc["tensors"]["x"]["sharding"].update(dims=[[0, 1], [1, 1]]),
        ),
        "listed and ruled": lambda: doc["tensors"]["x"].update(chunks=[]),
    }
    label = rng.choice(sorted(claims))
    claims[label]()
    write_manifest(ckpt, doc)
    return f"claim: {label}"


def _index_of(ckpt: Path, name: str) -> tuple[int, int]:
    text, start = header_of(ckpt, name)
    lo, hi = json.loads(text)["/index"]["data_offsets"]
    return start + lo, start + hi


def _index_bytes(rng: random.Random, ckpt: Path) -> str:
    """Damage to a ruled file's index bytes, its checksum left as it was."""
    name = rng.choice(_ruled_files(ckpt))
    lo, hi = _index_of(ckpt, name)
    raw = bytearray((ckpt / name).read_bytes())
    op = rng.choice(["flip", "flip", "zero", "truncate", "append"])
    if op == "flip":
        for _ in range(rng.choice([1, 1, 2, 8])):
            at = rng.randrange(lo, hi)
            raw[at] ^= 1 << rng.randrange(8)
    elif op == "zero":
        at, n = rng.randrange(lo, hi), rng.choice([1, 8, 16])
        raw[at : at + n] = bytes(len(raw[at : at + n]))
    elif op == "truncate":
        raw = raw[: rng.randrange(lo, hi)]
    else:
        raw += bytes(rng.randrange(256) for _ in range(rng.choice([1, 8, 24])))
    (ckpt / name).write_bytes(bytes(raw))
    return f"index {op} {name}"


def _index_rewrite(rng: random.Random, ckpt: Path) -> str:
    """A ruled file's index changed by a hostile author, ``index_checksum`` made right again (and the
    file's size where it changed)."""
    name = rng.choice(_ruled_files(ckpt))
    lo, hi = _index_of(ckpt, name)
    raw = bytearray((ckpt / name).read_bytes())
    index = bytearray(raw[lo:hi])
    units = [index[i : i + 8] for i in range(0, len(index), 8)]
    op = rng.choice(["swap", "change", "drop", "duplicate", "zero", "reverse"])
    if op == "swap" and len(units) > 1:
        i, j = rng.sample(range(len(units)), 2)
        units[i], units[j] = units[j], units[i]
    elif op == "change":
        i = rng.randrange(len(units))
        units[i] = bytearray(rng.randrange(256) for _ in range(8))
    elif op == "drop":
        del units[rng.randrange(len(units))]
    elif op == "duplicate":
        i = rng.randrange(len(units))
        units.insert(i, units[i])
    elif op == "zero":
        units = [bytearray(8) for _ in units]
    else:
        units.reverse()
    new = b"".join(units)
    (ckpt / name).write_bytes(bytes(raw[:lo]) + new + bytes(raw[hi:]))
    doc = manifest_of(ckpt)
    doc["files"][name]["index_checksum"] = xxhash.xxh3_64_hexdigest(new)
    doc["files"][name]["size"] += len(new) - len(index)
    write_manifest(ckpt, doc)
    return f"index rewritten ({op}), checksum fixed: {name}"


def _header_entry(rng: random.Random, ckpt: Path) -> str:
    """A ruled file's header edited (its ``/shards`` or ``/index`` entry, or another entry added), the
    header's checksum and length made right again (tests/hostile.py ``rewrite_header``)."""
    name = rng.choice(_ruled_files(ckpt))
    text, _ = header_of(ckpt, name)
    header: Doc = json.loads(text)
    key = rng.choice(["/shards", "/index"])
    op = rng.choice(
        ["shape", "offsets", "dtype", "swap", "drop", "rename", "extra", "extra first", "grow", "mutate", "mutate"]
    )
    if op == "shape":
        header[key]["shape"] = [header[key]["shape"][0] + rng.choice([-8, -1, 1, 8, 2**40])]
    elif op == "offsets":
        a, b = header[key]["data_offsets"]
        header[key]["data_offsets"] = [a + rng.choice([-1, 1, 0, 8]), b + rng.choice([-8, 1, 0, 2**40])]
    elif op == "dtype":
        header[key]["dtype"] = rng.choice(["I8", "F32", "BOOL", "I64"])
    elif op == "swap":
        header = {"__metadata__": header["__metadata__"], "/index": header["/index"], "/shards": header["/shards"]}
    elif op == "drop":
        header.pop(key)
    elif op == "rename":
        header[key + "x"] = header.pop(key)
    elif op in ("extra", "extra first"):
        extra = {"x": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}}
        rest = {k: v for k, v in header.items() if k != "__metadata__"}
        header = {"__metadata__": header["__metadata__"], **(extra | rest if op == "extra first" else rest | extra)}
    elif op == "grow":  # the ruled region claims one more chunk's worth, the index with it
        header["/shards"]["shape"] = [header["/shards"]["shape"][0] + 16]
        header["/shards"]["data_offsets"][1] += 16
        header["/index"]["data_offsets"] = [o + 16 for o in header["/index"]["data_offsets"]]
    else:
        header, what, fragment = mutate(rng, header)
        raw = json.dumps(header, separators=(",", ":"))
        if fragment is not None:
            raw = raw.replace(json.dumps(PLACEHOLDER), fragment)
        rewrite_header(ckpt, name, raw.encode())
        return f"{name}: header {what}"
    rewrite_header(ckpt, name, json.dumps(header, separators=(",", ":")).encode())
    return f"{name}: header {op} ({key!r})"


def _file(rng: random.Random, ckpt: Path) -> str:
    name = rng.choice(_ruled_files(ckpt))
    op = rng.choice(["missing", "fifo", "empty"])
    (ckpt / name).unlink()
    if op == "fifo":
        os.mkfifo(ckpt / name)
    elif op == "empty":
        (ckpt / name).write_bytes(b"")
    return f"{name} -> {op}"
