"""The importer treats its source as hostile: a damaged torch.save file (a flipped byte in a tensor record
or in ``data.pkl``, a cut file) is refused naming the file and the record, never imported silently; sizes
a file declares are checked against what it holds before anything is allocated (stride-0 views, zip
bombs, storages larger than their record, legacy files with lying sizes); only ``CheckpointError``\\ s
escape, and ``shardsafe import`` exits 1 for a damaged source without suggesting ``--allow-pickle``.
DCP folders (``--allow-pickle``) are read from regular files only, under a deadline."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from craft import Call, Storage, View, bomb, data_offset, flip, legacy_file, zip_file
from shardsafe.cli import main
from shardsafe.errors import CheckpointError, CorruptCheckpointError, UnsafeValueError

TESTS = Path(__file__).resolve().parent
SRC = Path(shardsafe.__file__).resolve().parents[1]
CAP = 1 << 30  # bytes a child importing a few KB may grow by (its address space, beyond torch's import)


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {"w": torch.randn(16, 8), "b": torch.arange(5, dtype=torch.int64), "step": 3, "name": "run"}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = main(["import", *argv])
    out, err = capsys.readouterr()
    return rc, out + err


def _children(codes: list[str], timeout: float = 120) -> list[dict[str, Any]]:
    """Run each of ``codes`` in turn in one fresh interpreter whose address space may grow by :data:`CAP`
    beyond what importing torch takes; the outcome of each as a dict (``hang`` for those a timeout cut)."""
    blocks = "\n".join(
        f"""
out = {{"rss_before_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}
try:
{chr(10).join("    " + line for line in code.strip().splitlines())}
    out["ok"] = True
except BaseException as err:
    chain, cur = [], err
    while cur is not None and len(chain) < 10:
        chain.append(f"{{type(cur).__name__}}: {{str(cur)[:400]}}")
        cur = cur.__cause__ or cur.__context__
    out.update(error=type(err).__name__, checkpoint_error=isinstance(err, shardsafe.CheckpointError),
               message=str(err), chain=chain)
out["rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out), flush=True)
"""
        for code in codes
    )
    script = f"""
import json, resource, sys, traceback
import torch, shardsafe
with open("/proc/self/statm") as f:
    used = int(f.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (used + {CAP}, resource.RLIM_INFINITY))
{blocks}
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS)]), "OMP_NUM_THREADS": "1"}
    try:
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, env=env)
        stdout, stderr = run.stdout, run.stderr
    except subprocess.TimeoutExpired as cut:
        stdout = cut.stdout.decode() if isinstance(cut.stdout, bytes) else (cut.stdout or "")
        stderr = ""
    got = [json.loads(line) for line in stdout.strip().splitlines() if line.startswith("{")]
    assert got or stderr == "", stderr[-3000:]
    return got + [{"hang": True}] * (len(codes) - len(got))


def _child(code: str, timeout: float = 120) -> dict[str, Any]:
    return _children([code], timeout)[0]


def _refused_without_allocating(outcome: dict[str, Any], *words: str) -> None:
    assert not outcome.get("hang"), "the import hung"
    assert outcome.get("checkpoint_error"), outcome
    chain = outcome["chain"]
    failed = [c for c in chain if c.startswith("MemoryError") or (c.startswith("RuntimeError") and "alloc" in c)]
    assert not failed, outcome  # an allocation was tried and failed
    for word in words:
        assert word in outcome["message"], (word, outcome["message"])


# ---------------------------------------------------------------------------------- damaged bytes


@pytest.mark.parametrize("record", ["data/0", "data.pkl"])
def test_a_flipped_byte_in_a_zip_record_is_refused_naming_the_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], record: str
) -> None:
    src = tmp_path / "m.pt"
    torch.save(_state(), src)
    # data/0 is "w": byte 5 of its floats; data.pkl: the key "w" (what a silent import would rename)
    offset = data_offset(src, record) + (5 if record == "data/0" else _pickle_key_offset(src, b"w"))
    flip(src, offset, 0x04)
    with pytest.raises(CorruptCheckpointError, match="CRC-32") as refused:
        shardsafe.import_checkpoint(src, tmp_path / "dest")
    assert str(src) in str(refused.value) and record in str(refused.value)
    rc, text = _cli(capsys, str(src), str(tmp_path / "dest"))
    assert rc == 1 and "CRC-32" in text and "allow-pickle" not in text and text.count("\n") == 1, text
    assert not (tmp_path / "dest").exists()


def _pickle_key_offset(src: Path, key: bytes) -> int:
    with zipfile.ZipFile(src) as z:
        pkl = z.read("m/data.pkl")
    return pkl.index(b"X\x01\x00\x00\x00" + key) + 5  # BINUNICODE, length 1, the key


def test_cut_and_flipped_files_raise_only_checkpoint_errors(tmp_path: Path) -> None:
    """Every cut of a zip and of a legacy file, and flips spread over both: a CheckpointError, or (a flip
    the formats cannot see: zip padding, legacy tensor bytes) an import holding the source's structure;
    for the zip format, exactly its bytes."""
    state = _state()
    files = {"zip": tmp_path / "z.pt", "legacy": tmp_path / "l.pt"}
    torch.save(state, files["zip"])
    torch.save(state, files["legacy"], _use_new_zipfile_serialization=False)
    escaped, silent, n = [], [], 0
    for kind, src in files.items():
        raw = src.read_bytes()
        variants = [raw[:cut] for cut in range(0, len(raw), max(1, len(raw) // 60))]
        variants += [
            raw[:i] + bytes([raw[i] ^ 0x10]) + raw[i + 1 :] for i in range(0, len(raw), max(1, len(raw) // 80))
        ]
        for i, data in enumerate(variants):
            case = tmp_path / f"{kind}-{i}.pt"
            case.write_bytes(data)
            dest = tmp_path / f"out-{kind}-{i}"
            n += 1
            try:
                shardsafe.import_checkpoint(case, dest)
            except CheckpointError:
                assert not dest.exists()
                continue
            except Exception as err:
                escaped.append(f"{kind} variant {i}: {type(err).__name__}: {err}")
                continue
            got = shardsafe.load(dest)
            exact = _same(got, state)
            shape_only = list(got) == list(state) and all(
                not isinstance(v, torch.Tensor) or (got[k].shape == v.shape and got[k].dtype == v.dtype)
                for k, v in state.items()
            )
            if not (exact or (kind == "legacy" and shape_only)):
                silent.append(f"{kind} variant {i} imported other data")
    assert n > 250 and not escaped and not silent, escaped[:10] + silent[:10]


def test_a_storage_larger_than_its_record_is_refused(tmp_path: Path) -> None:
    s = Storage("0", torch.float32, 64)  # 256 bytes declared, 16 in the record; the next records follow it
    src = zip_file(
        tmp_path / "m.pt",
        {"w": View(s, (64,), (1,)), "tail": View(Storage("1", torch.float32, 4), (4,), (1,))},
        {"0": bytes(16), "1": bytes(16)},
    )
    with pytest.raises(CorruptCheckpointError, match=r"data/0.*(256|16) bytes") as refused:
        shardsafe.import_checkpoint(src, tmp_path / "dest")
    assert str(src) in str(refused.value)
    assert not (tmp_path / "dest").exists()


def test_a_view_past_its_storage_and_a_bad_persistent_id_are_refused(tmp_path: Path) -> None:
    s = Storage("0", torch.float32, 4)
    for i, obj in enumerate(
        [
            {"w": View(s, (8,), (1,))},  # 8 elements of a 4-element storage
            {"w": View(s, (2,), (1,), offset=3)},
            {"w": View(Storage("9", torch.float32, 4), (4,), (1,))},  # no record data/9
        ]
    ):
        src = zip_file(tmp_path / f"m{i}.pt", obj, {"0": bytes(16)})
        with pytest.raises(CorruptCheckpointError):
            shardsafe.import_checkpoint(src, tmp_path / f"dest{i}")


# ---------------------------------------------------------------------------------- sizes and memory


def test_a_stride_0_view_is_not_materialised_beyond_the_bound(tmp_path: Path) -> None:
    src = tmp_path / "expand.pt"
    torch.save({"w": torch.zeros(1).expand(2**28)}, src)  # 1,5xx bytes that would become 1 GiB
    assert src.stat().st_size < 4096
    outcome = _child(f"shardsafe.import_checkpoint({str(src)!r}, {str(tmp_path / 'dest')!r})")
    _refused_without_allocating(outcome, "bound", "'w'", str(src))
    assert not (tmp_path / "dest").exists()


def test_a_small_overlapping_view_is_written_as_what_it_is(tmp_path: Path) -> None:
    """Within the bound, an overlapping view imports as the tensor it is (every element, materialised)."""
    base = torch.arange(40, dtype=torch.float32)
    view = base.as_strided((30, 10), (1, 1))
    src = tmp_path / "view.pt"
    torch.save({"v": view, "row": base[:10].expand(3, 10)}, src)
    shardsafe.import_checkpoint(src, tmp_path / "dest")
    got = shardsafe.load(tmp_path / "dest")
    assert torch.equal(got["v"], view) and torch.equal(got["row"], base[:10].expand(3, 10))


def test_a_zip_bomb_is_refused_in_bounded_memory(tmp_path: Path) -> None:
    src = bomb(tmp_path / "bomb.pt", 1 << 30)  # 1 GiB of zeros, deflated
    assert src.stat().st_size < 3 << 20
    outcome = _child(f"shardsafe.import_checkpoint({str(src)!r}, {str(tmp_path / 'dest')!r})")
    _refused_without_allocating(outcome, "bound", "data/0")
    # Peak growth over what the interpreter held before the call (torch's own footprint differs by build):
    # a bomb read whole would add 1 GiB.
    assert outcome["rss_mib"] - outcome["rss_before_mib"] < 400, outcome


def test_legacy_files_with_lying_sizes_are_refused_before_allocating(tmp_path: Path) -> None:
    data = torch.arange(4, dtype=torch.float32).numpy().tobytes()
    honest = legacy_file(
        tmp_path / "honest.pt", {"w": View(Storage("k", torch.float32, 4), (4,), (1,))}, [("k", torch.float32, data)]
    )
    assert torch.equal(torch.load(honest, weights_only=True)["w"], torch.arange(4.0))  # the crafting is faithful
    shardsafe.import_checkpoint(honest, tmp_path / "honest-dest")
    assert torch.equal(shardsafe.load(tmp_path / "honest-dest")["w"], torch.arange(4.0))
    cases = {
        "declared": legacy_file(  # the pickle declares 4 Gi elements (16 GiB), the file holds 16 bytes
            tmp_path / "declared.pt",
            {"w": View(Storage("k", torch.float32, 2**32), (4,), (1,))},
            [("k", torch.float32, data)],
        ),
        "header": legacy_file(  # the pickle and the bytes agree, the element count before them lies
            tmp_path / "header.pt",
            {"w": View(Storage("k", torch.float32, 4), (4,), (1,))},
            [("k", torch.float32, data)],
            header_numel={"k": 2**40},
        ),
    }
    codes = [f"shardsafe.import_checkpoint({str(src)!r}, {str(tmp_path / name)!r})" for name, src in cases.items()]
    for (name, src), outcome in zip(cases.items(), _children(codes), strict=True):
        _refused_without_allocating(outcome, str(src))
        assert not (tmp_path / name).exists()


def test_with_allow_pickle_a_view_larger_than_its_storage_allocates_nothing(tmp_path: Path) -> None:
    """Full unpickling runs torch's own tensor rebuilds, whose ``set_`` grows a storage too small for its
    view: a legacy file of a few hundred bytes asked for 8 GiB. Storages cannot grow, and the views are
    checked as in weights-only reading."""
    data = torch.arange(4, dtype=torch.float32).numpy().tobytes()
    big = {"w": View(Storage("k", torch.float32, 4), (2**31,), (1,))}  # 8 GiB from 16 bytes
    empty = {"w": View(Storage("k", torch.float32, 0), (2**31,), (1,))}
    sources = {
        "legacy": legacy_file(tmp_path / "legacy.pt", big, [("k", torch.float32, data)]),
        "legacy-empty": legacy_file(tmp_path / "legacy-empty.pt", empty, [("k", torch.float32, b"")]),
        "zip": zip_file(tmp_path / "zip.pt", big, {"k": data}),
        "zip-empty": zip_file(tmp_path / "zip-empty.pt", empty, {"k": b""}),
    }
    assert all(src.stat().st_size < 1000 for src in sources.values())
    codes = [
        f"shardsafe.import_checkpoint({str(src)!r}, {str(tmp_path / name)!r}, allow_pickle=True)"
        for name, src in sources.items()
    ]
    for (name, src), outcome in zip(sources.items(), _children(codes), strict=True):
        _refused_without_allocating(outcome, str(src), "reaches element")
        assert outcome["error"] == "CorruptCheckpointError", (name, outcome)
        assert not (tmp_path / name).exists()


# ---------------------------------------------------------------------------------- refusal vs damage


def test_unsafe_content_is_refused_as_such_and_damage_is_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    proof = tmp_path / "code-ran"
    evil = zip_file(tmp_path / "evil.pt", {"w": Call(os.system, f"touch {proof}")}, {})
    with pytest.raises(UnsafeValueError, match=r"posix\.system|os\.system"):
        shardsafe.import_checkpoint(evil, tmp_path / "d0")
    rc, text = _cli(capsys, str(evil), str(tmp_path / "d0"))
    assert rc == 2 and "--allow-pickle" in text
    # allocation through allowed constructors (weights_only's own allowlist has these): refused, never run
    codes = []
    for i, obj in enumerate(
        [Call(bytearray, 1 << 40), Call(torch.Tensor, 1 << 40), Call(torch.UntypedStorage, 1 << 40)]
    ):
        src = zip_file(tmp_path / f"alloc{i}.pt", {"w": obj}, {})
        codes.append(f"shardsafe.import_checkpoint({str(src)!r}, {str(tmp_path / f'a{i}')!r})")
    for outcome in _children(codes):
        _refused_without_allocating(outcome)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"\x00not a torch file" * 10)
    for args in ([], ["--allow-pickle"]):
        rc, text = _cli(capsys, str(garbage), str(tmp_path / "d1"), *args)
        assert rc == 1 and "allow-pickle" not in text and str(garbage) in text, text
    assert not proof.exists()


def test_nesting_and_cycles_are_refused_cleanly(tmp_path: Path) -> None:
    for depth in (200, 100_000):  # nested lists built by the unpickler's loop, not by recursion
        pkl = b"\x80\x02}X\x01\x00\x00\x00d" + b"]" * depth + b"a" * (depth - 1) + b"s."
        src = zip_file(tmp_path / f"deep{depth}.pt", None, {}, pkl=pkl)
        with pytest.raises(CheckpointError, match="deep"):
            shardsafe.import_checkpoint(src, tmp_path / f"d{depth}")
    cyc: list[Any] = []
    cyc.append(cyc)
    torch.save({"c": cyc}, tmp_path / "cycle.pt")
    with pytest.raises(CheckpointError, match="itself"):
        shardsafe.import_checkpoint(tmp_path / "cycle.pt", tmp_path / "d1")


def test_legacy_and_zip_files_import_like_torch_load(tmp_path: Path) -> None:
    """The importer's own reader gives what torch.load gives: structure, dtypes, shared storages."""
    torch.manual_seed(0)
    w = torch.randn(6, 4)
    state = {
        "model": {"w": w, "t": w.t(), "half": w[:3], "p": torch.nn.Parameter(torch.ones(2))},
        "ints": torch.arange(7, dtype=torch.int16),
        "bf": torch.randn(3).bfloat16(),
        "mask": torch.tensor([True, False]),
        "values": {"lr": 0.1, "betas": (0.9, 0.99), 3: None, "b": b"\x00\xff", "size": torch.Size([2, 3])},
        "empty": torch.zeros(0, 3),
        "scalar": torch.tensor(2.5),
    }
    for legacy in (False, True):
        src = tmp_path / f"s{int(legacy)}.pt"
        torch.save(state, src, _use_new_zipfile_serialization=not legacy)
        dest = tmp_path / f"d{int(legacy)}"
        result = shardsafe.import_checkpoint(src, dest)
        assert result.keys == list(state)
        got = shardsafe.load(dest)
        ref = torch.load(src, weights_only=True)
        for k in ("ints", "bf", "mask", "empty", "scalar"):
            assert _same(got[k], ref[k]), k
        assert all(torch.equal(got["model"][k], ref["model"][k]) for k in ref["model"])
        assert got["values"]["betas"] == (0.9, 0.99) and got["values"]["b"] == b"\x00\xff"


# ---------------------------------------------------------------------------------- DCP sources


def _dcp(path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"model": {"w": torch.randn(8, 4), "b": torch.zeros(4)}, "step": 2}, checkpoint_id=str(path))


def test_a_dcp_folder_with_a_fifo_is_refused_not_waited_on(tmp_path: Path) -> None:
    for name in ("data", "meta"):
        _dcp(tmp_path / name)
    data = next(p for p in (tmp_path / "data").iterdir() if p.suffix == ".distcp")
    meta = tmp_path / "meta" / ".metadata"
    for fifo in (data, meta):
        fifo.unlink()
        os.mkfifo(fifo)
    codes = [
        f"shardsafe.import_checkpoint({str(tmp_path / name)!r}, {str(tmp_path / 'dest')!r}, allow_pickle=True)"
        for name in ("data", "meta")
    ]
    for fifo, outcome in zip((data, meta), _children(codes, timeout=90), strict=True):
        _refused_without_allocating(outcome, "regular file", fifo.name)
    assert not (tmp_path / "dest").exists()


def test_a_dcp_read_runs_under_a_deadline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shardsafe.interop import dcpread

    _dcp(tmp_path / "dcp")
    release = threading.Event()
    real = dcpread.read_slice

    def stuck(*args: Any, **kwargs: Any) -> Any:
        release.wait(30)  # a storage that stopped answering
        return real(*args, **kwargs)

    monkeypatch.setattr(dcpread, "read_slice", stuck)
    try:
        with pytest.raises(CheckpointError, match=r"did not finish within 1s"):
            shardsafe.import_checkpoint(tmp_path / "dcp", tmp_path / "dest", allow_pickle=True, timeout=1)
    finally:
        release.set()
    assert not (tmp_path / "dest").exists()


def test_damaged_dcp_bytes_and_lying_metadata_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _dcp(tmp_path / "dcp")
    data = next(p for p in (tmp_path / "dcp").iterdir() if p.suffix == ".distcp")
    raw = data.read_bytes()
    torch.manual_seed(0)  # find "w"'s bytes: torch.randn(8, 4) under seed 0, as _dcp saved it
    w = torch.randn(8, 4)
    at = raw.index(w.numpy().tobytes()[:16])
    flip(data, at + 2)
    with pytest.raises(CorruptCheckpointError, match="CRC-32") as refused:
        shardsafe.import_checkpoint(tmp_path / "dcp", tmp_path / "dest", allow_pickle=True)
    assert data.name in str(refused.value)
    rc, text = _cli(capsys, str(tmp_path / "dcp"), str(tmp_path / "dest"), "--allow-pickle")
    assert rc == 1 and "allow-pickle" not in text.split("ERROR", 1)[-1], text
    flip(data, at + 2)  # repaired; now the metadata declares a 2**40-element tensor
    meta = tmp_path / "dcp" / ".metadata"
    md = pickle.loads(meta.read_bytes())
    md.state_dict_metadata["model.w"].size = torch.Size([2**20, 2**20])
    meta.write_bytes(pickle.dumps(md))
    outcome = _child(
        f"shardsafe.import_checkpoint({str(tmp_path / 'dcp')!r}, {str(tmp_path / 'dest')!r}, allow_pickle=True)"
    )
    _refused_without_allocating(outcome, "bound", "model.w")
    assert not (tmp_path / "dest").exists()
