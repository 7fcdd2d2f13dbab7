"""Seeded, structure-aware fuzzing of the importer and of export targets, for tests/test_fuzz_import.py:
:func:`build` makes one case from the reference sources (:func:`references`), and ``python
fuzz_import.py SPEC.json`` runs cases in a child (the parent kills a child that stays on one case past its
deadline, and records a hang).

Import cases damage or craft a source:

- ``zip-bytes``, ``legacy-bytes``, ``dcp-bytes``, ``dcp-meta-bytes``, ``hf-bytes``: bit flips, cuts,
  appended, zeroed or inserted bytes of a file;
- ``zip-pickle``, ``legacy-pickle``: opcode-level edits of the pickle (an argument replaced by a hostile
  int, text or global; an opcode deleted, duplicated, swapped or inserted), the zip re-packed with every
  CRC-32 right (so the edits reach the unpickler);
- ``zip-records``: records cut, grown, swapped, deleted, duplicated, renamed, deflated, a zip bomb, the
  byte order; every CRC-32 right;
- ``crafted``: what a hostile author writes (code to run, allocating constructors, codec chains, views
  past their storage or repeating it, deep nesting, cycles, shared-reference blow-ups);
- ``legacy-sizes``: element counts that lie (declared and written), storage keys that do not match;
- ``dcp-meta``: DCP's metadata object edited (sizes, dtypes, chunks, file names, offsets) and re-pickled;
- ``dcp-fs``, ``hf-fs``: a FIFO, a folder, a symlink to ``/dev/zero`` or in a loop, a missing file;
- ``hf-header``, ``hf-index``: JSON edits of a safetensors header or of the shard index.

``export`` cases aim a checkpoint (sometimes damaged: a flipped byte, an incremental one whose base
became a file) at a hostile target (a file, a FIFO, a symlink, a folder with other files, a forged or
nested export marker, a path under a regular file or inside the checkpoint) in each format.

The child's invariants (violations): ``escape`` (an exception that is not a CheckpointError; for the
CLI, a traceback, a wrong exit status, more than one line, or ``--allow-pickle`` advice for damage),
``alloc`` (a failed allocation anywhere in an exception's chain, or the peak RSS growing past half the
cap), ``silent`` (an import that succeeded on damaged bytes with other content: exactly the source's
tensors and values for the zip format and DCP data, whose records carry CRC-32s; for bytes no
checksum covers, what the format's own reader reads from them: such changes are counted), ``write``
(anything changed outside the import's destination or the export's target, or a failed operation
that left something behind), ``code`` (a proof file a payload creates), ``export`` (a successful
export that is not complete).
"""

from __future__ import annotations

import _codecs
import io
import json
import os
import pickle
import pickletools
import random
import resource
import shutil
import struct
import sys
import time
import traceback
import zipfile
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import torch

from craft import Call, Storage, View, legacy_file, zip_file

KINDS = (
    ["zip-bytes"] * 6
    + ["zip-pickle"] * 5
    + ["zip-records"] * 4
    + ["crafted"] * 5
    + ["legacy-bytes"] * 3
    + ["legacy-pickle"] * 2
    + ["legacy-sizes"] * 2
    + ["dcp-bytes"] * 3
    + ["dcp-meta-bytes"]
    + ["dcp-meta"] * 3
    + ["dcp-fs"] * 2
    + ["hf-bytes"] * 2
    + ["hf-header"] * 3
    + ["hf-index"] * 2
    + ["hf-fs"]
    + ["export"] * 8
)
EXACT = {"zip-bytes", "dcp-bytes"}
"""Damage the format's CRC-32s must catch: an import that succeeds holds exactly the source."""
ORACLE = {"legacy-bytes", "dcp-meta-bytes", "hf-bytes"}
"""Damage in bytes no checksum covers (a legacy pickle, DCP metadata, a safetensors file): an import that
succeeds holds what the format's own reader (torch.load, DCP, safetensors) reads from the same bytes."""
DAMAGE = EXACT | ORACLE
"""Byte damage: the CLI must never advise --allow-pickle for it."""

# ------------------------------------------------------------------------------------ references


def ref_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 4, generator=g)
    return {
        "model": {
            "w": w,
            "b": torch.zeros(4),
            "ids": torch.arange(5),
            "bf": torch.randn(3, generator=g).bfloat16(),
            "mask": torch.tensor([True, False]),
        },
        "view": w[1:3],
        "opt": {
            "state": {"w": {"step": torch.tensor(2.0), "exp_avg": torch.ones(6, 4)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["w", "b"]}],
        },
        "step": 7,
        "name": "run",
        "values": [1, (2.5, None), {"k": b"\x00\x01"}],
    }


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def references(root: Path) -> dict[str, Path]:
    """The pristine sources every case starts from."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import shardsafe

    root.mkdir(parents=True)
    refs = {"zip": root / "zip.pt", "legacy": root / "legacy.pt"}
    torch.save(ref_state(), refs["zip"])
    torch.save(ref_state(), refs["legacy"], _use_new_zipfile_serialization=False)
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optim": osd, "step": 7}, checkpoint_id=str(root / "dcp"))
    refs["dcp"] = root / "dcp"
    _hf(root / "hf", sharded=False)
    _hf(root / "hf-sharded", sharded=True)
    refs["hf"], refs["hf-sharded"] = root / "hf", root / "hf-sharded"
    shardsafe.save(root / "ckpt", {"model": _model(), "step": 1})
    refs["ckpt"] = root / "ckpt"
    m = _model()
    shardsafe.save(root / "inc" / "s1", {"model": m})
    with torch.no_grad():
        m[1].bias.add_(1)
    shardsafe.save(root / "inc" / "s2", {"model": m}, base=root / "inc" / "s1")
    refs["inc"] = root / "inc"
    return refs


def _hf(folder: Path, sharded: bool) -> None:
    from safetensors.torch import save_file

    folder.mkdir()
    g = torch.Generator().manual_seed(1)
    tensors = {
        "transformer.w": torch.randn(8, 4, generator=g),
        "transformer.b": torch.randn(4, generator=g),
        "transformer.ids": torch.arange(6, dtype=torch.int32),
        "head.weight": torch.randn(4, 3, generator=g).half(),
    }
    if not sharded:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(tensors)
    parts = [names[:2], names[2:]]
    weight_map = {}
    for i, part in enumerate(parts):
        file = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


# ------------------------------------------------------------------------------------ building


def build(refs: dict[str, Path], case: Path, seed: int) -> dict[str, Any]:
    """Case ``seed`` in the folder ``case``: its description (``kind``, ``what``, ``mode`` and what the
    child needs)."""
    rng = random.Random(seed)
    case.mkdir(parents=True)
    (case / "victim").write_text("precious")
    kind = rng.choice(KINDS)
    if kind == "export":
        return {"kind": kind, "mode": "export", **_export(rng, refs, case)}
    ref = {"zip": "zip", "cra": "zip", "leg": "legacy", "dcp": "dcp", "hf-": rng.choice(["hf", "hf-sharded"])}[kind[:3]]
    if kind.startswith("hf-") and kind == "hf-bytes" and rng.random() < 0.3:
        ref = "hf-file"
    src = case / ("src" if ref in ("dcp", "hf", "hf-sharded") else "src.pt")
    if ref == "hf-file":
        shutil.copyfile(refs["hf"] / "model.safetensors", src)
    elif src.suffix:
        shutil.copyfile(refs[ref], src)
    else:
        shutil.copytree(refs[ref], src)
    what = BUILDERS[kind](rng, src, case)
    return {
        "kind": kind,
        "mode": "import",
        "what": what,
        "ref": "hf" if ref.startswith("hf") else ref,
        "source": str(src),
        "allow_pickle": ref == "dcp",  # never where hostile globals are injected: full unpickling runs them
    }


def _file_of(rng: random.Random, src: Path, meta: bool | None = None) -> Path:
    if src.is_file():
        return src
    files = sorted(p for p in src.iterdir() if p.is_file())
    if meta is not None:
        files = [p for p in files if (p.name == ".metadata") == meta] or files
    return rng.choice(files)


def _bytes(rng: random.Random, src: Path, case: Path, meta: bool | None = None) -> str:
    path = _file_of(rng, src, meta)
    raw = bytearray(path.read_bytes())
    op = rng.choice(["flip"] * 5 + ["cut", "append", "zero", "insert"])
    if op == "flip":
        for _ in range(rng.choice([1, 1, 1, 2, 3, 8])):
            at = rng.randrange(len(raw))
            raw[at] ^= 1 << rng.randrange(8)
    elif op == "cut":
        raw = raw[: rng.randrange(len(raw))]
    elif op == "append":
        raw += bytes(rng.randrange(256) for _ in range(rng.choice([1, 7, 100])))
    elif op == "zero":
        at, n = rng.randrange(len(raw)), rng.choice([1, 8, 64])
        raw[at : at + n] = bytes(len(raw[at : at + n]))
    else:
        at = rng.randrange(len(raw))
        raw[at:at] = bytes(rng.randrange(256) for _ in range(rng.choice([1, 3])))
    path.write_bytes(bytes(raw))
    return f"{op} {path.name}"


# -- pickles


HOSTILE_INTS = [0, 1, 2, 3, 4, 5, 7, 255, 256, 65535, 2**31 - 1, -1, -(2**31), 2**32, 2**40, 2**62, 2**63, 10**30]
HOSTILE_TEXT = ["", "storage", "0", "1", "9", "../x", "data.pkl", "cpu", "cuda:0", "meta", "x" * 3000, "\u202e", "w"]
HOSTILE_GLOBALS = [
    "posix system", "builtins eval", "builtins exec", "builtins getattr", "os system", "subprocess Popen",
    "torch Tensor", "torch FloatTensor", "builtins bytearray", "_codecs encode", "builtins set", "builtins complex",
    "torch._utils _rebuild_tensor_v2", "torch._utils _rebuild_parameter", "torch._utils _rebuild_qtensor",
    "torch._utils _rebuild_sparse_tensor", "torch._utils _rebuild_meta_tensor_no_storage",
    "torch._utils _rebuild_wrapper_subclass", "torch._utils _rebuild_device_tensor_from_cpu_tensor",
    "torch._tensor _rebuild_from_type_v2", "torch FloatStorage", "torch DoubleStorage", "torch UntypedStorage",
    "torch.storage UntypedStorage", "collections OrderedDict", "collections Counter", "torch Size", "torch device",
    "torch float32", "torch int64", "numpy.core.multiarray _reconstruct", "torch.nn.parameter Parameter",
    "builtins bytes", "__builtin__ set", "torch serialization", "a\nb c",
]  # fmt: skip
_SIMPLE = {
    "EMPTY_DICT": b"}", "EMPTY_LIST": b"]", "EMPTY_TUPLE": b")", "MARK": b"(", "TUPLE": b"t", "TUPLE1": b"\x85",
    "TUPLE2": b"\x86", "TUPLE3": b"\x87", "NONE": b"N", "NEWTRUE": b"\x88", "NEWFALSE": b"\x89", "REDUCE": b"R",
    "BUILD": b"b", "SETITEM": b"s", "SETITEMS": b"u", "APPEND": b"a", "APPENDS": b"e", "BINPERSID": b"Q",
    "NEWOBJ": b"\x81", "MEMOIZE": b"\x94", "EMPTY_SET": b"\x8f", "STOP": b".", "POP": b"0", "DUP": b"2",
    "STACK_GLOBAL": b"\x93", "ADDITEMS": b"\x90", "POP_MARK": b"1",
}  # fmt: skip


def ops_of(data: bytes) -> list[tuple[str, Any]]:
    return [(op.name, arg) for op, arg, _ in pickletools.genops(data)]


def _int(value: int) -> tuple[str, int]:
    if 0 <= value < 256:
        return "BININT1", value
    if -(2**31) <= value < 2**31:
        return "BININT", value
    return "LONG1", value


def assemble(ops: list[tuple[str, Any]]) -> bytes:
    out = bytearray()
    for name, arg in ops:
        if name in _SIMPLE:
            out += _SIMPLE[name]
        elif name == "PROTO":
            out += b"\x80" + bytes([arg])
        elif name == "BININT1":
            out += b"K" + bytes([arg])
        elif name == "BININT2":
            out += b"M" + struct.pack("<H", arg)
        elif name == "BININT":
            out += b"J" + struct.pack("<i", arg)
        elif name == "LONG1":
            enc = pickle.encode_long(arg)  # type: ignore[attr-defined]
            out += b"\x8a" + bytes([len(enc)]) + enc
        elif name == "BINFLOAT":
            out += b"G" + struct.pack(">d", arg)
        elif name in ("BINUNICODE", "SHORT_BINUNICODE"):
            enc = arg.encode("utf-8", "surrogatepass")
            out += b"X" + struct.pack("<I", len(enc)) + enc
        elif name in ("SHORT_BINSTRING", "SHORT_BINBYTES"):
            enc = arg if isinstance(arg, bytes) else arg.encode("latin1")
            out += (b"U" if name == "SHORT_BINSTRING" else b"C") + bytes([len(enc)]) + enc
        elif name == "BINBYTES":
            out += b"B" + struct.pack("<I", len(arg)) + arg
        elif name == "GLOBAL":
            module, _, attr = arg.partition(" ")
            out += b"c" + module.encode() + b"\n" + attr.encode() + b"\n"
        elif name in ("BINPUT", "BINGET"):
            out += (b"q" if name == "BINPUT" else b"h") + bytes([arg])
        elif name in ("LONG_BINPUT", "LONG_BINGET"):
            out += (b"r" if name == "LONG_BINPUT" else b"j") + struct.pack("<I", arg)
        elif name == "FRAME":
            continue
        else:
            raise KeyError(name)
    return bytes(out)


def mutate_pickle(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    ops = ops_of(data)
    done = []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        if len(ops) < 3:
            break
        i = rng.randrange(1, len(ops) - 1)
        name = ops[i][0]
        op = rng.choice(["arg"] * 4 + ["delete", "duplicate", "swap", "insert"])
        if op == "arg" and name in ("BININT1", "BININT2", "BININT", "LONG1"):
            ops[i] = _int(rng.choice(HOSTILE_INTS))
        elif op == "arg" and name in ("BINUNICODE", "SHORT_BINUNICODE"):
            ops[i] = ("BINUNICODE", rng.choice(HOSTILE_TEXT))
        elif op == "arg" and name == "GLOBAL":
            ops[i] = ("GLOBAL", rng.choice(HOSTILE_GLOBALS))
        elif op == "arg" and name in ("BINGET", "BINPUT"):
            ops[i] = (name, rng.randrange(256))
        elif op == "delete":
            del ops[i]
        elif op == "duplicate":
            ops.insert(i, ops[i])
        elif op == "swap":
            j = rng.randrange(1, len(ops) - 1)
            ops[i], ops[j] = ops[j], ops[i]
        else:
            ops.insert(
                i, rng.choice([(n, None) for n in _SIMPLE if n != "STOP"] + [("GLOBAL", rng.choice(HOSTILE_GLOBALS))])
            )
        done.append(f"{op} at op {i} ({name})")
    return assemble(ops), "; ".join(done)


def _records(path: Path) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(path) as z:
        return [(i.filename, z.read(i.filename)) for i in z.infolist()]


def _repack(path: Path, records: list[tuple[str, bytes]], deflate: set[str] | None = None) -> None:
    import warnings

    with warnings.catch_warnings():  # duplicate names, on purpose
        warnings.simplefilter("ignore")
        with zipfile.ZipFile(path, "w") as z:
            for name, data in records:
                kind = zipfile.ZIP_DEFLATED if deflate and name in deflate else zipfile.ZIP_STORED
                z.writestr(name, data, compress_type=kind)


def _zip_pickle(rng: random.Random, src: Path, case: Path) -> str:
    records = _records(src)
    i = next(i for i, (n, _) in enumerate(records) if n.endswith("data.pkl"))
    data, what = mutate_pickle(rng, records[i][1])
    records[i] = (records[i][0], data)
    _repack(src, records)
    return what


def _zip_records(rng: random.Random, src: Path, case: Path) -> str:
    records = _records(src)
    data = [i for i, (n, _) in enumerate(records) if "/data/" in n]
    i = rng.choice(data)
    name, raw = records[i]
    op = rng.choice(["cut", "grow", "swap", "delete", "duplicate", "rename", "deflate", "bomb", "big", "order"])
    deflate = None
    if op == "cut":
        records[i] = (name, raw[: rng.randrange(len(raw) + 1)])
    elif op == "grow":
        records[i] = (name, raw + bytes(rng.choice([1, 4, 1000])))
    elif op == "swap":
        j = rng.choice(data)
        records[i], records[j] = (name, records[j][1]), (records[j][0], raw)
    elif op == "delete":
        del records[i]
    elif op == "duplicate":
        records.insert(i, (name, bytes(len(raw))))
    elif op == "rename":
        records[i] = (rng.choice(["other/" + name.split("/", 1)[1], name + "x", "x", name.replace("data/", "")]), raw)
    elif op == "deflate":
        deflate = {name}
    elif op == "bomb":
        records[i], deflate = (name, bytes(rng.choice([80, 200]) << 20)), {name}
    elif op == "big":
        records.append((name.split("/")[0] + "/junk", bytes(1 << 16)))
    else:
        records = [
            (n, rng.choice([b"big", b"BIG", b"", b"little\n"]) if n.endswith("byteorder") else d) for n, d in records
        ]
    _repack(src, records, deflate)
    return f"{op} {name}"


def _crafted(rng: random.Random, src: Path, case: Path) -> str:
    proof = str(case / "PROOF")
    s = Storage("0", torch.float32, 16)
    cases: dict[str, Any] = {
        "system": Call(os.system, f"touch {proof}"),
        "eval": Call(eval, f"open({proof!r}, 'w')"),
        "exec": Call(exec, f"open({proof!r}, 'w')"),
        "bytearray": Call(bytearray, 1 << 40),
        "Tensor": Call(torch.Tensor, 1 << 40),
        "FloatTensor": Call(torch.FloatTensor, 1 << 36),
        "UntypedStorage": Call(torch.UntypedStorage, 1 << 40),
        "codecs": Call(_codecs.encode, Call(_codecs.encode, Call(_codecs.encode, b"x" * 1000, "hex"), "hex"), "hex"),
        "stride0": View(s, (1 << 30,), (0,)),
        "overlap": View(s, (1 << 14, 1 << 14), (1, 1)),
        "past": View(s, (17,), (1,)),
        "offset": View(s, (4,), (1,), offset=15),
        "dims": View(s, (1,) * 65, (1,) * 65),
        "negative": View(s, (-1,), (1,)),
        "huge-numel": View(Storage("0", torch.float32, 2**61), (4,), (1,)),
        "deep": _deep(rng.choice([150, 5000])),
        "dag": _dag(rng.choice([30, 60])),
        "set": {1, 2, 3},
        "meta": Call(torch._utils._rebuild_meta_tensor_no_storage, torch.float32, (1 << 40,), (1,), False),
    }
    label = rng.choice(sorted(cases))
    obj = {"w": View(s, (16,), (1,)), "x": cases[label]}
    zip_file(src, obj, {"0": bytes(64)})
    return label


def _deep(depth: int) -> Any:
    value: Any = [1]
    for _ in range(min(depth, 400)):  # deeper is written raw: pickling it would recurse
        value = [value]
    return value


def _dag(levels: int) -> Any:
    value: Any = [torch.zeros(1)]
    for _ in range(levels):
        value = [value, value]
    return value


# -- legacy


def _pickle_bounds(raw: bytes) -> list[tuple[int, int]]:
    """(start, end) of the five pickles at the head of a legacy file."""
    out, pos = [], 0
    for _ in range(5):
        end = pos
        for _, _, at in pickletools.genops(raw[pos:]):
            end = pos + at
        out.append((pos, end + 1))
        pos = end + 1
    return out


def _legacy_pickle(rng: random.Random, src: Path, case: Path) -> str:
    raw = src.read_bytes()
    bounds = _pickle_bounds(raw)
    k = rng.choice([0, 1, 2, 3, 3, 3, 4])
    a, b = bounds[k]
    data, what = mutate_pickle(rng, raw[a:b])
    src.write_bytes(raw[:a] + data + raw[b:])
    return f"pickle {k}: {what}"


def _legacy_sizes(rng: random.Random, src: Path, case: Path) -> str:
    data = torch.arange(4, dtype=torch.float32).numpy().tobytes()
    op = rng.choice(["declared", "header", "keys-missing", "keys-extra", "keys-dup", "trailing", "view", "magic"])
    numel = {"declared": rng.choice([5, 2**20, 2**32, 2**61])}.get(op, 4)
    s = Storage("k", torch.float32, numel)
    obj = {"w": View(s, (4,), (1,))}
    storages = [("k", torch.float32, data)]
    header = {"k": rng.choice([0, 3, 5, 2**40, -1])} if op == "header" else None
    legacy_file(src, obj, storages, header_numel=header)
    raw = src.read_bytes()
    bounds = _pickle_bounds(raw)
    if op.startswith("keys"):
        keys = {"keys-missing": [], "keys-extra": ["k", "z"], "keys-dup": ["k", "k"]}[op]
        a, b = bounds[4]
        raw = raw[:a] + pickle.dumps(keys, protocol=2) + raw[b:]
    elif op == "trailing":
        raw += b"junk"
    elif op == "view":
        a, b = bounds[3]
        ops = ops_of(raw[a:b])
        at = max(i for i, (n, _) in enumerate(ops) if n == "NONE" and i < len(ops) - 5)
        ops[at : at + 1] = [
            ("MARK", None),
            ("BINUNICODE", "v"),
            _int(rng.choice([0, 3, 2**40])),
            _int(rng.choice([1, 2**40])),
            ("TUPLE", None),
        ]
        raw = raw[:a] + assemble(ops) + raw[b:]
    elif op == "magic":
        a, b = bounds[rng.choice([0, 1, 2])]
        raw = raw[:a] + pickle.dumps(rng.choice([0, 1001, "x", {"little_endian": False}]), protocol=2) + raw[b:]
    src.write_bytes(raw)
    return op


# -- DCP


def _dcp_meta(rng: random.Random, src: Path, case: Path) -> str:
    import dataclasses

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = pickle.loads((src / ".metadata").read_bytes())
    op = rng.choice(["size", "dtype", "chunk", "path", "offset", "length", "drop", "planner", "transform", "type"])
    tensors = [k for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)]
    key = rng.choice(tensors)
    entry = md.state_dict_metadata[key]
    items = list(md.storage_data)
    index = rng.choice(items)
    info = md.storage_data[index]
    if op == "size":
        new = torch.Size([rng.choice([0, 1, 3, 2**20, 2**31, 2**40]) for _ in entry.size] or [2**40])
        md.state_dict_metadata[key] = dataclasses.replace(entry, size=new)
    elif op == "dtype":
        props = dataclasses.replace(entry.properties, dtype=rng.choice([torch.float64, torch.int8, torch.bool]))
        md.state_dict_metadata[key] = dataclasses.replace(entry, properties=props)
    elif op == "chunk":
        chunk = entry.chunks[0]
        md.state_dict_metadata[key].chunks[0] = dataclasses.replace(
            chunk, sizes=torch.Size([v + rng.choice([1, 2**30]) for v in chunk.sizes] or [5])
        )
    elif op == "path":
        name = rng.choice(["../victim", "/etc/passwd", ".metadata", "missing", "victim", "", "sub/x"])
        md.storage_data[index] = dataclasses.replace(info, relative_path=name)
    elif op == "offset":
        md.storage_data[index] = dataclasses.replace(info, offset=rng.choice([-1, 10**9, info.offset + 1]))
    elif op == "length":
        md.storage_data[index] = dataclasses.replace(info, length=rng.choice([0, 10**9, info.length - 1, -5]))
    elif op == "drop":
        del md.storage_data[index]
    elif op == "planner":
        md.planner_data[rng.choice(list(md.planner_data))] = rng.choice([(), ("x", 5, "y"), (0,), ("model",)])
    elif op == "transform" and hasattr(info, "transform_descriptors"):
        md.storage_data[index] = dataclasses.replace(info, transform_descriptors=["zstd"])
    else:
        md.state_dict_metadata[key] = rng.choice([None, 5, "x", [entry]])
    (src / ".metadata").write_bytes(pickle.dumps(md))
    return f"{op} ({key})"


def _fs(rng: random.Random, src: Path, case: Path) -> str:
    path = _file_of(rng, src)
    op = rng.choice(["fifo", "fifo", "dir", "loop", "dangling", "devzero", "missing", "outside"])
    if op == "outside":
        os.rename(path, case / "moved")
        os.symlink(case / "moved", path)
        return f"{path.name} -> symlink out of the folder (a regular file)"
    path.unlink()
    if op == "fifo":
        os.mkfifo(path)
    elif op == "dir":
        path.mkdir()
    elif op == "loop":
        os.symlink(path.name, path)
    elif op == "dangling":
        os.symlink("nowhere", path)
    elif op == "devzero":
        os.symlink("/dev/zero", path)
    return f"{path.name} -> {op}"


# -- safetensors


def _hf_header(rng: random.Random, src: Path, case: Path) -> str:
    path = _file_of(rng, src) if src.is_file() else rng.choice(sorted(src.glob("*.safetensors")))
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    name = rng.choice([k for k in header if k != "__metadata__"])
    op = rng.choice(["dtype", "shape", "offsets", "delete", "add", "dup", "raw", "meta", "length"])
    text = None
    if op == "dtype":
        header[name]["dtype"] = rng.choice(["F64", "I8", "BOOL", "X9", 5, None])
    elif op == "shape":
        header[name]["shape"] = rng.choice([[], [2**40], [-1], [1.5], "x", [1] * 70, [0]])
    elif op == "offsets":
        a, b = header[name]["data_offsets"]
        header[name]["data_offsets"] = rng.choice([[b, a], [a, b + 4], [a + 4, b + 4], [0, 2**62], [a], "x", [-4, b]])
    elif op == "delete":
        del header[name]
    elif op == "add":
        header["extra"] = rng.choice([{"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, 5, {}])
    elif op == "meta":
        header["__metadata__"] = rng.choice([5, {"format": 5}, [], None])
    elif op == "dup":
        text = json.dumps(header)[:-1] + f', "{name}": ' + json.dumps(header[name]) + "}"
    elif op == "raw":
        text = rng.choice(["[]", "{", '{"a": NaN}', "[" * 100_000, '"x"', "\xff"])
    body = (text if text is not None else json.dumps(header)).encode("utf-8", "surrogateescape")
    if op == "length":
        path.write_bytes(struct.pack("<Q", rng.choice([0, n - 1, n + 1, 2**60])) + raw[8:])
    else:
        path.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n :])
    return f"{op} {name} in {path.name}"


def _hf_index(rng: random.Random, src: Path, case: Path) -> str:
    index_path = src / "model.safetensors.index.json"
    if not index_path.exists():
        return _hf_header(rng, src, case)
    index = json.loads(index_path.read_text())
    name = rng.choice(sorted(index["weight_map"]))
    op = rng.choice(["file", "missing", "drop", "add", "map", "raw"])
    if op == "file":
        index["weight_map"][name] = rng.choice(["../victim", "/etc/passwd", "victim", "x.safetensors", "", 5])
    elif op == "missing":
        for shard in set(index["weight_map"].values()):
            (src / shard).unlink()
            break
    elif op == "drop":
        del index["weight_map"][name]
    elif op == "add":
        index["weight_map"]["ghost"] = next(iter(index["weight_map"].values()))
    elif op == "map":
        index["weight_map"] = rng.choice([[], {}, None, "x"])
    text = rng.choice(["[" * 100_000, "{", "null"]) if op == "raw" else json.dumps(index)
    index_path.write_text(text)
    return f"{op} {name}"


BUILDERS = {
    "zip-bytes": _bytes,
    "legacy-bytes": _bytes,
    "hf-bytes": _bytes,
    "dcp-bytes": lambda rng, src, case: _bytes(rng, src, case, meta=False),
    "dcp-meta-bytes": lambda rng, src, case: _bytes(rng, src, case, meta=True),
    "zip-pickle": _zip_pickle,
    "zip-records": _zip_records,
    "crafted": _crafted,
    "legacy-pickle": _legacy_pickle,
    "legacy-sizes": _legacy_sizes,
    "dcp-meta": _dcp_meta,
    "dcp-fs": _fs,
    "hf-fs": _fs,
    "hf-header": _hf_header,
    "hf-index": _hf_index,
}


# -- export targets


def _export(rng: random.Random, refs: dict[str, Path], case: Path) -> dict[str, Any]:
    fmt = rng.choice(["hf", "hf", "torch", "shardsafe"])
    source_kind = rng.choice(["ckpt"] * 4 + ["flip", "inc", "base-file", "base-gone"])
    if source_kind in ("inc", "base-file", "base-gone"):
        shutil.copytree(refs["inc"] / "s1", case / "s1")
        shutil.copytree(refs["inc"] / "s2", case / "ckpt")
        os.rename(case / "ckpt", case / "s2")
        ckpt = case / "s2"
        if source_kind == "base-file":
            shutil.rmtree(case / "s1")
            (case / "s1").write_text("a file now")
        elif source_kind == "base-gone":
            shutil.rmtree(case / "s1")
    else:
        shutil.copytree(refs["ckpt"], case / "ckpt")
        ckpt = case / "ckpt"
        if source_kind == "flip":
            data = rng.choice(sorted(ckpt.glob("data-*")))
            raw = bytearray(data.read_bytes())
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
            data.write_bytes(bytes(raw))
    out = case / "out"
    target = rng.choice(
        ["absent", "empty", "junk", "file", "fifo", "symlink-dir", "symlink-file", "dangling", "under-file",
         "under-fifo", "deep", "inside", "nested-marker", "forged-marker", "previous", "previous-plus"]
    )  # fmt: skip
    if target == "empty":
        out.mkdir()
    elif target == "junk":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    elif target == "file":
        out.write_text("mine")
    elif target == "fifo":
        os.mkfifo(out)
    elif target == "symlink-dir":
        (case / "real").mkdir()
        out.symlink_to(case / "real")
    elif target == "symlink-file":
        out.symlink_to(case / "victim")
    elif target == "dangling":
        out.symlink_to(case / "nowhere")
    elif target == "under-file":
        out = case / "victim" / "out"
    elif target == "under-fifo":
        os.mkfifo(case / "pipe")
        out = case / "pipe" / "out"
    elif target == "deep":
        out = case / "a" / "b" / "out"
    elif target == "inside":
        out = ckpt / "out"
    elif target in ("nested-marker", "forged-marker"):
        out.mkdir()
        text = (
            "[" * 200_000
            if target == "nested-marker"
            else json.dumps(
                {
                    "format": "shardsafe-export",
                    "version": 1,
                    "files": [rng.choice(["../victim", "link", "missing", ".."])],
                }
            )
        )
        (out / ".shardsafe-export.json").write_text(text)
        (out / "link").symlink_to(case / "victim")
    elif target.startswith("previous"):
        out.mkdir()
        (out / "model.safetensors").write_bytes(b"old")
        (out / ".shardsafe-export.json").write_text(
            json.dumps({"format": "shardsafe-export", "version": 1, "files": ["model.safetensors"]})
        )
        if target == "previous-plus":
            (out / "tokenizer.json").write_text("{}")
    return {
        "what": f"{fmt} of {source_kind} to {target}",
        "format": fmt,
        "source": str(ckpt),
        "target": str(out),
        "overwrite": rng.random() < 0.5,
        "expect": {"ckpt": "ckpt", "flip": "ckpt", "inc": "inc"}.get(source_kind),
    }


# ------------------------------------------------------------------------------------ the child


def flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """Every tensor (dtype, shape, bytes) and plain value of ``value`` by path."""
    out: dict[str, Any] = {}
    if isinstance(value, torch.Tensor):
        t = value.detach().contiguous()
        out[prefix] = ("tensor", str(t.dtype), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, dict):
        for k, v in value.items():
            out.update(flat(v, f"{prefix}/{k}"))
    elif isinstance(value, (list, tuple)):
        out[prefix] = ("seq", type(value).__name__, len(value))
        for i, v in enumerate(value):
            out.update(flat(v, f"{prefix}/{i}"))
    else:
        out[prefix] = ("value", repr(value))
    return out


def snapshot(root: Path, skip: tuple[Path, ...]) -> list[tuple[str, int, int, bytes]]:
    out = []
    skipped = {str(p) for p in skip}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = [d for d in dirnames if os.path.join(dirpath, d) not in skipped]
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            if p in skipped:
                continue
            st = os.lstat(p)
            data = b""
            if os.path.isfile(p) and not os.path.islink(p) and st.st_size < 1 << 20:
                with open(p, "rb") as f:
                    data = f.read()
            out.append((os.path.relpath(p, root), st.st_mode, st.st_size, data))
    return sorted(out)


def chain(err: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    cur: BaseException | None = err
    while cur is not None and cur not in seen:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


class Runner:
    def __init__(self, spec: dict[str, Any]) -> None:
        import shardsafe

        self.shardsafe = shardsafe
        self.scratch = Path(spec["scratch"])
        self.memory = int(spec["memory"])
        refs = {k: Path(v) for k, v in spec["refs"].items()}
        self.expected: dict[str, dict[str, Any]] = {}
        for name, allow in (("zip", False), ("legacy", False), ("dcp", True), ("hf", False)):
            dest = self.scratch / f"ref-{name}"
            if dest.exists():
                shutil.rmtree(dest)
            shardsafe.import_checkpoint(refs[name], dest, allow_pickle=allow)
            self.expected[name] = flat(shardsafe.load(dest, allow_pickle=allow))
            shutil.rmtree(dest)
        s2 = _model()
        with torch.no_grad():
            s2[1].bias.add_(1)
        self.export_expected = {"ckpt": flat(dict(_model().state_dict())), "inc": flat(dict(s2.state_dict()))}
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (used + self.memory, resource.RLIM_INFINITY))
        self.rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def run(self, case: dict[str, Any], cli: bool) -> dict[str, Any]:
        violations: list[dict[str, str]] = []
        outcome = self._import(case, cli, violations) if case["mode"] == "import" else self._export(case, violations)
        if (Path(case["dir"]) / "PROOF").exists():
            violations.append({"kind": "code", "op": case["mode"], "detail": "the payload ran"})
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if rss - self.rss0 > self.memory // 2:
            violations.append({"kind": "alloc", "op": "any", "detail": f"peak RSS grew by {rss - self.rss0} bytes"})
            self.rss0 = rss
        return {"outcome": outcome, "violations": violations}

    def _attempt(self, op: str, fn: Any, violations: list[dict[str, str]]) -> tuple[bool, Any]:
        try:
            return True, fn()
        except Exception as err:
            if not isinstance(err, self.shardsafe.CheckpointError):
                violations.append(
                    {"kind": "escape", "op": op, "detail": "".join(traceback.format_exception(err))[-3000:]}
                )
            for e in chain(err):
                if isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and "alloc" in str(e).lower()):
                    violations.append({"kind": "alloc", "op": op, "detail": f"{type(e).__name__}: {str(e)[:300]}"})
            return False, err

    def _import(self, case: dict[str, Any], cli: bool, violations: list[dict[str, str]]) -> str:
        root, dest = Path(case["dir"]), Path(case["dir"]) / "dest"
        before = (snapshot(root, (dest,)), snapshot(self.scratch, ()))
        allow = case["allow_pickle"]
        ok, err = self._attempt(
            "import",
            lambda: self.shardsafe.import_checkpoint(case["source"], dest, allow_pickle=allow, timeout=20),
            violations,
        )
        if ok:
            got = flat(self.shardsafe.load(dest, allow_pickle=allow))
            want = self.expected[case["ref"]]
            if case["kind"] in EXACT and got != want:
                violations.append({"kind": "silent", "op": "import", "detail": "damaged, yet imported other data"})
            if case["kind"] in ORACLE and got != want:
                case["undetectable"] = True  # bytes no checksum covers: counted
                oracle = self._oracle(case)
                if oracle is not None and oracle != got:
                    violations.append(
                        {"kind": "silent", "op": "import", "detail": "imported other data than the format's own reader"}
                    )
        elif dest.exists() or os.path.lexists(dest):
            violations.append({"kind": "write", "op": "import", "detail": "a failed import left its destination"})
        if (snapshot(root, (dest,)), snapshot(self.scratch, ())) != before:
            violations.append({"kind": "write", "op": "import", "detail": "something beside the destination changed"})
        if cli:
            self._cli(case, ok, err, violations)
        return "ok" if ok else type(err).__name__

    @staticmethod
    def _oracle(case: dict[str, Any]) -> dict[str, Any] | None:
        """What the format's own reader reads from the case's source (None when it cannot)."""
        src = Path(case["source"])
        try:
            if case["ref"] == "legacy":
                return flat(torch.load(src, weights_only=True))
            if case["ref"] == "hf":
                from safetensors.torch import load_file

                files = [src] if src.is_file() else sorted(src.glob("*.safetensors"))
                return flat({"model": {k: v for f in files for k, v in load_file(str(f)).items()}})
            import warnings

            from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
            from torch.distributed.checkpoint.filesystem import FileSystemReader
            from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

            state: dict[str, Any] = {}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                planner = _EmptyStateDictLoadPlanner()
                _load_state_dict(state, storage_reader=FileSystemReader(str(src)), planner=planner, no_dist=True)
            return flat(state)
        except BaseException:  # the reference reader failing is an answer too
            return None

    def _cli(self, case: dict[str, Any], ok: bool, err: Any, violations: list[dict[str, str]]) -> None:
        from shardsafe.cli import main

        dest = Path(case["dir"]) / "dest-cli"
        argv = ["import", case["source"], str(dest)] + (["--allow-pickle"] if case["allow_pickle"] else [])
        out, errs = io.StringIO(), io.StringIO()
        try:
            with redirect_stdout(out), redirect_stderr(errs):
                rc = main(argv)
        except BaseException as exc:
            violations.append({"kind": "escape", "op": "cli", "detail": f"{type(exc).__name__}: {exc}"[:500]})
            return
        want = 0 if ok else (2 if isinstance(err, self.shardsafe.UnsafeValueError) else 1)
        text = errs.getvalue() if rc else out.getvalue()
        advice = rc and "allow-pickle" in text and case["kind"] in DAMAGE
        if rc != want or text.count("\n") != 1 or "Traceback" in text or advice:
            violations.append({"kind": "escape", "op": "cli", "detail": f"exit {rc} (want {want}): {text[:500]!r}"})
        if dest.exists():
            shutil.rmtree(dest)

    def _export(self, case: dict[str, Any], violations: list[dict[str, str]]) -> str:
        root, target = Path(case["dir"]), Path(case["target"])
        created = [p for p in [target.parent, target.parent.parent] if not os.path.lexists(p)]
        before = snapshot(root, ())
        fmt = case["format"]

        def run() -> Any:
            if fmt == "hf":
                return self.shardsafe.export_hf(case["source"], target, overwrite=case["overwrite"])
            if fmt == "torch":
                return self.shardsafe.export_torch(case["source"], target)
            from shardsafe.interop.consolidate import consolidate

            return consolidate(case["source"], target)

        ok, err = self._attempt("export", run, violations)
        if not ok:
            if snapshot(root, ()) != before:
                violations.append({"kind": "write", "op": "export", "detail": "a failed export changed something"})
            return type(err).__name__
        if snapshot(root, (target, *created)) != [e for e in before if not _under(root / e[0], target)]:
            violations.append({"kind": "write", "op": "export", "detail": "something beside the target changed"})
        if case["expect"] is None:
            violations.append({"kind": "silent", "op": "export", "detail": "exported without the data of its base"})
            return "ok"
        try:
            got = self._exported(fmt, target)
        except Exception as err:
            violations.append({"kind": "export", "op": "export", "detail": f"{type(err).__name__}: {err}"[:300]})
            return "ok"
        if got != self.export_expected[case["expect"]]:
            violations.append({"kind": "silent", "op": "export", "detail": "the export holds other data"})
        return "ok"

    def _exported(self, fmt: str, target: Path) -> dict[str, Any]:
        """What a complete export at ``target`` holds (raises if it is not complete)."""
        if fmt == "hf":
            from safetensors.torch import load_file

            from shardsafe.interop.outdir import previous_export

            files = previous_export(str(target))
            if not files:
                raise AssertionError("the target is not a complete export")
            out: dict[str, Any] = {}
            for name in files:
                if name.endswith(".safetensors"):
                    out.update(load_file(str(target / name)))
            return flat(out)
        if fmt == "torch":
            return flat(torch.load(target, weights_only=True))
        self.shardsafe.verify(target)
        return flat(self.shardsafe.load(target)["model"])


def _under(p: Path, root: Path) -> bool:
    return p == root or root in p.parents


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    runner = Runner(spec)
    with open(spec["results"], "a", buffering=1) as results:
        for case in spec["cases"]:
            results.write(json.dumps({"start": case["id"]}) + "\n")
            started = time.monotonic()
            outcome = runner.run(case, cli=case["id"] % spec["cli_every"] == 0)
            extra = {"undetectable": True} if case.get("undetectable") else {}
            results.write(
                json.dumps({"id": case["id"], "seconds": time.monotonic() - started, **outcome, **extra}) + "\n"
            )


if __name__ == "__main__":
    main(sys.argv[1])
