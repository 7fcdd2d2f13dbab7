"""Hostile checkpoints, one test per root cause of a broken promise: whatever a checkpoint holds,
reading it (``inspect``, ``verify``, ``load``, ``load(state)``, the CLI) raises a ``CheckpointError``
naming the file, in bounded time and memory, writes nothing, imports nothing, and never runs away
with the machine. The seeded fuzz test (tests/test_fuzz.py) covers the combinations."""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

import shardsafe
from hostile import (
    PLACEHOLDER,
    Doc,
    chunk_of,
    data_files,
    deep_list,
    edit_manifest,
    fresh_state,
    header_of,
    manifest_of,
    reshard,
    rewrite_header,
    save_base,
    write_raw_manifest,
)
from shardsafe import CheckpointError, CorruptCheckpointError
from shardsafe.cli import main as cli

SRC = str(Path(shardsafe.__file__).resolve().parents[1])


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pristine") / "ckpt"
    save_base(path)
    return path


@pytest.fixture
def ckpt(pristine: Path, tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    path.mkdir()
    for f in pristine.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    return path


def manifest_readers(path: Path) -> dict[str, Callable[[], object]]:
    return {
        "inspect": lambda: shardsafe.inspect(path),
        "verify": lambda: shardsafe.verify(path),
        "load": lambda: shardsafe.load(path),
        "load(state)": lambda: shardsafe.load(path, fresh_state(), timeout=30),
    }


DATA_READERS = ("verify", "load", "load(state)")  # inspect reads only the manifest


def refused(path: Path, *words: str, readers: tuple[str, ...] = ()) -> None:
    """Every reader (or those named) raises exactly CorruptCheckpointError naming ``words``."""
    for name, read in manifest_readers(path).items():
        if readers and name not in readers:
            continue
        with pytest.raises(CheckpointError) as info:
            read()
        err = info.value
        assert type(err) is CorruptCheckpointError, f"{name}: {type(err).__name__}: {err}"
        text = str(err).replace(str(path.parent), "<tmp>")  # the test's name is in the path
        for word in words:
            assert word in text, f"{name}: {word!r} not in {text!r}"


class Hung(BaseException):
    """Raised in the main thread when a call overruns its guard (a BaseException, so that no
    ``except Exception`` of the code under test can turn it into something else)."""


@contextmanager
def guard(seconds: float) -> Iterator[None]:
    """Interrupt the main thread (even inside a blocking ``open``) after ``seconds``: a hang fails the
    test instead of stalling the suite."""

    def fire(*_: Any) -> None:
        raise Hung(f"still running after {seconds}s")

    old = signal.signal(signal.SIGUSR1, fire)
    main = threading.main_thread().ident
    assert main is not None
    timer = threading.Timer(seconds, lambda: signal.pthread_kill(main, signal.SIGUSR1))
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, old)


@pytest.fixture
def fifos() -> Iterator[list[Path]]:
    """FIFOs a test creates; at teardown every reader still blocked opening one is released."""
    made: list[Path] = []
    yield made
    for fifo in made:
        for _ in range(8):
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                break  # no reader waiting
            os.close(fd)


@contextmanager
def memory_cap(extra: int) -> Iterator[None]:
    """Cap this process's address space at its current size plus ``extra`` bytes for the block (so a
    runaway read or allocation fails fast instead of taking the machine's memory)."""
    with open("/proc/self/statm") as f:
        used = int(f.read().split()[0]) * resource.getpagesize()
    old = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (used + extra, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, old)


def in_child(code: str, tmp_path: Path, *, memory: int = 2**30) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter whose address space may grow by at most ``memory`` bytes
    beyond what importing torch takes, with TMPDIR and HOME inside ``tmp_path``."""
    prelude = textwrap.dedent(
        f"""
        import resource, shardsafe, torch
        [getattr(shardsafe, name) for name in shardsafe.__all__]  # the whole API (imported on first use) first
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (used + {memory}, resource.RLIM_INFINITY))
        """
    )
    sandbox = tmp_path / "sandbox"
    sandbox.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": SRC,
        "TMPDIR": str(sandbox),
        "HOME": str(sandbox),
        "MALLOC_ARENA_MAX": "2",
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        env=env,
        cwd=sandbox,
        capture_output=True,
        text=True,
        timeout=120,
    )


# ------------------------------------------------------------------------- nesting depth


def test_deeply_nested_manifest_json(ckpt: Path) -> None:
    doc = manifest_of(ckpt)
    doc["objects"]["step"]["value"] = PLACEHOLDER
    write_raw_manifest(ckpt, doc, deep_list(100_000))
    refused(ckpt, "MANIFEST.json", "nested")


def test_deeply_nested_typed_value(ckpt: Path) -> None:
    """Not deep enough to trouble the JSON parser, deep enough for a recursive decoder."""
    doc = manifest_of(ckpt)
    doc["objects"]["step"]["value"] = PLACEHOLDER
    doc["metadata"] = PLACEHOLDER
    write_raw_manifest(ckpt, doc, '{"$":"tuple","items":[' * 300 + "]}" * 300)
    refused(ckpt, "MANIFEST.json", "nested")


def test_deeply_nested_safetensors_header(ckpt: Path) -> None:
    name = data_files(ckpt)[0]
    text, _ = header_of(ckpt, name)
    rewrite_header(ckpt, name, text.rstrip(b" ")[:-1] + b',"deep":' + deep_list(100_000).encode() + b"}")
    refused(ckpt, name, "nested", readers=("verify",))


# ------------------------------------------------------------------ safetensors headers


def test_header_that_is_a_json_list(ckpt: Path) -> None:
    name = data_files(ckpt)[0]
    rewrite_header(ckpt, name, b"[1,2,3]")
    refused(ckpt, name, "header", readers=("verify",))


@pytest.mark.parametrize(
    "damage", ["nan", "bom", "utf-16", "extra entry", "metadata not text", "tab padding", "dtype not a name"]
)
def test_header_must_be_strict(ckpt: Path, damage: str) -> None:
    name = data_files(ckpt)[0]
    text, _ = header_of(ckpt, name)
    body = text.rstrip(b" ")
    new = {
        "nan": body[:-1] + b',"junk":NaN}',
        "bom": b"\xef\xbb\xbf" + body,
        "utf-16": body.decode().encode("utf-16"),
        "extra entry": body[:-1] + b',"junk":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}',
        "metadata not text": body.replace(b'"writer":"shardsafe"', b'"writer":["shardsafe"]'),
        "tab padding": body + b"\t" * (-(len(body) + 8) % 8 or 8),
        # a dtype that is not a name (a dict is unhashable: the check raised TypeError, the save of an
        # incremental checkpoint on it an UnforeseenError: found by the writer fuzzer, seed 61, case 1411)
        "dtype not a name": re.sub(rb'"dtype":"[A-Z0-9]+"', b'"dtype":{"$":"device"}', body, count=1),
    }[damage]
    rewrite_header(ckpt, name, new, pad=damage != "tab padding")
    refused(ckpt, name, "header", readers=("verify",))


# ----------------------------------------------------------------------- numbers out of range


@pytest.mark.parametrize("created", [10**400, 1e300, -5.0, "1795355225"])
def test_created_out_of_range(ckpt: Path, created: Any) -> None:
    edit_manifest(ckpt, lambda d: d.update(created=created))
    refused(ckpt, "MANIFEST.json", "created")


@pytest.mark.parametrize(("dtype", "v"), [("uint8", -1), ("uint64", 2**64), ("int8", 128), ("bool", 1), ("float32", 1)])
def test_npscalar_value_out_of_range(ckpt: Path, dtype: str, v: Any) -> None:
    edit_manifest(ckpt, lambda d: d["objects"]["step"].update(value={"$": "npscalar", "dtype": dtype, "v": v}))
    refused(ckpt, "MANIFEST.json: step", "npscalar")


@pytest.mark.parametrize("dtype", ["V1", "V50000000", "U3", "S8", "O", "float128", "complex64", "datetime64[s]", "<f4"])
def test_npscalar_dtype_from_a_fixed_table(ckpt: Path, dtype: str) -> None:
    edit_manifest(ckpt, lambda d: d["objects"]["step"].update(value={"$": "npscalar", "dtype": dtype, "v": 0}))
    refused(ckpt, "MANIFEST.json: step", repr(dtype))


def test_byte_offset_of_2_pow_63(ckpt: Path) -> None:
    """A module parameter is read straight into the module, so its file size is not checked first:
    the range itself must be refused."""

    def change(d: Doc) -> None:
        c = chunk_of(d, "model/weight")
        c["begin"], c["end"] = 2**63, 2**63 + 48
        d["files"][c["file"]]["size"] = 2**63 + 48

    edit_manifest(ckpt, change)
    refused(ckpt, "MANIFEST.json", str(2**63)[:12])


@pytest.mark.parametrize("shape", [[0, 10**30], [0, 2**62, 2**62], [2**63]])
def test_zero_sized_absurd_shape(ckpt: Path, shape: list[int]) -> None:
    def change(d: Doc) -> None:
        t = d["tensors"]["empty"]
        t["shape"] = shape
        t["chunks"][0]["sizes"] = shape

    edit_manifest(ckpt, change)
    refused(ckpt, "MANIFEST.json", "'empty'", "shape")


# ------------------------------------------------------------------ typed JSON, names, types


@pytest.mark.parametrize(
    "node",
    [
        {"$": "tuple", "items": "abc"},
        {"$": "tuple", "items": {"a": 1}},
        {"$": "dict", "items": "ab"},
        {"$": "dict", "items": [["a", 1, 2]]},
        {"$": "size", "v": "123"},
        {"$": "size", "v": [-1, 2]},
        {"$": "size", "v": [1.5]},
        {"$": "size", "v": [True]},
        {"$": "bytes", "b64": ["AA=="]},
        {"$": "dtype", "v": ["float32"]},
        {"$": "float", "v": ["nan"]},
        {"$": "tensor", "ref": "x", "extra": 1},
        {"$": "device", "v": "cpu\n"},
    ],
    ids=repr,
)
def test_typed_nodes_are_type_checked_not_iterated(ckpt: Path, node: Doc) -> None:
    edit_manifest(ckpt, lambda d: d["objects"]["step"].update(value=node))
    refused(ckpt, "MANIFEST.json: step")


def test_file_name_with_a_trailing_newline(ckpt: Path) -> None:
    def change(d: Doc) -> None:
        (old,) = [n for n in d["files"] if n in {c["file"] for c in d["tensors"]["x"]["chunks"]}]
        d["files"][old + "\n"] = d["files"].pop(old)
        for t in d["tensors"].values():
            for c in t["chunks"]:
                c["file"] = old + "\n"

    edit_manifest(ckpt, change)
    refused(ckpt, "MANIFEST.json", "not a plain name")


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32", "utf-8-sig"])
def test_manifest_must_be_utf8_without_bom(ckpt: Path, encoding: str) -> None:
    text = (ckpt / "MANIFEST.json").read_text()
    (ckpt / "MANIFEST.json").write_bytes(text.encode(encoding))
    refused(ckpt, "MANIFEST.json", "UTF-8")


def test_nan_literal_in_manifest(ckpt: Path) -> None:
    doc = manifest_of(ckpt)
    doc["objects"]["step"]["value"] = PLACEHOLDER
    write_raw_manifest(ckpt, doc, "NaN")
    refused(ckpt, "MANIFEST.json")


def test_float_literal_that_overflows(ckpt: Path) -> None:
    doc = manifest_of(ckpt)
    doc["objects"]["step"]["value"] = PLACEHOLDER
    write_raw_manifest(ckpt, doc, "1e400")
    refused(ckpt, "MANIFEST.json", "1e400")


def test_tensor_with_zero_chunks(ckpt: Path) -> None:
    edit_manifest(ckpt, lambda d: d["tensors"]["empty"].update(chunks=[]))
    refused(ckpt, "MANIFEST.json", "'empty'", "chunk")


@pytest.mark.parametrize("checksums", ["abc", {"a": 1, "b": 2, "c": 3}, ["0" * 16, "0" * 16, 5], ["zz" * 8] * 3])
def test_checksums_must_be_a_list_of_digests(ckpt: Path, checksums: Any) -> None:
    edit_manifest(ckpt, lambda d: chunk_of(d, "x").update(checksums=checksums))
    refused(ckpt, "MANIFEST.json", "'x'", "checksum")


def test_dtype_names_are_never_looked_up_on_torch(pristine: Path, tmp_path: Path) -> None:
    """``getattr(torch, "_inductor")`` imports hundreds of modules that create cache folders: dtype
    names come from fixed tables instead. Checked in a fresh interpreter (this one may have imported
    them already), for a tensor's dtype and for a typed ``dtype`` value."""
    cases = []
    for i, dtype in enumerate(["_inductor", "_dynamo", "testing", "nn", "fx"]):
        for where in ("tensor", "value"):
            case = tmp_path / f"{where}-{i}"
            case.mkdir()
            for f in pristine.iterdir():
                (case / f.name).write_bytes(f.read_bytes())
            if where == "tensor":
                edit_manifest(case, lambda d, t=dtype: d["tensors"]["x"].update(dtype=t))
            else:
                edit_manifest(case, lambda d, t=dtype: d["objects"]["step"].update(value={"$": "dtype", "v": t}))
            cases.append((str(case), dtype))
    result = in_child(
        f"""
        import sys
        before = set(sys.modules)
        for path, dtype in {cases!r}:
            for read in (shardsafe.inspect, shardsafe.verify, shardsafe.load):
                try:
                    read(path)
                except shardsafe.CorruptCheckpointError as err:
                    assert dtype in str(err), err
                else:
                    raise AssertionError(f"{{path}} accepted")
        print(sorted(m for m in set(sys.modules) - before if m.startswith("torch.")))
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    assert os.listdir(tmp_path / "sandbox") == []


# ---------------------------------------------------------------- files that are not files


def test_symlink_loop(ckpt: Path) -> None:
    name = _own_file(ckpt, "model/weight")
    (ckpt / name).unlink()
    os.symlink(name, ckpt / name)
    refused(ckpt, name, "loop", readers=DATA_READERS)
    (ckpt / "MANIFEST.json").unlink()
    os.symlink("MANIFEST.json", ckpt / "MANIFEST.json")
    refused(ckpt, "MANIFEST.json")


def _own_file(ckpt: Path, tensor: str) -> str:
    """Move ``tensor`` into a data file of its own; returns that file's name."""
    reshard(ckpt, tensor, [0])
    (name,) = {c["file"] for c in manifest_of(ckpt)["tensors"][tensor]["chunks"]}
    return str(name)


@pytest.mark.parametrize("which", ["data", "manifest"])
def test_directory_in_place_of_a_file(ckpt: Path, which: str) -> None:
    """A data file that only module parameters read is opened without a size check first."""
    name = _own_file(ckpt, "model/weight") if which == "data" else "MANIFEST.json"
    (ckpt / name).unlink()
    (ckpt / name).mkdir()
    refused(ckpt, name, "directory", readers=DATA_READERS if which == "data" else ())


@pytest.mark.parametrize("which", ["data", "manifest"])
def test_fifo_in_place_of_a_file(ckpt: Path, which: str, fifos: list[Path]) -> None:
    """Opening a FIFO for reading blocks until a writer comes: it must be refused without opening."""
    name = _own_file(ckpt, "model/weight") if which == "data" else "MANIFEST.json"
    (ckpt / name).unlink()
    os.mkfifo(ckpt / name)
    fifos.append(ckpt / name)
    with guard(60):
        refused(ckpt, name, "not a regular file", readers=DATA_READERS if which == "data" else ())


def test_symlink_out_of_the_checkpoint(ckpt: Path, tmp_path: Path) -> None:
    """Even to a file with the right bytes: a checkpoint reads nothing outside itself."""
    name = data_files(ckpt)[0]
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    os.rename(ckpt / name, outside / name)
    os.symlink(outside / name, ckpt / name)
    refused(ckpt, name, "outside", readers=DATA_READERS)
    os.rename(ckpt / "MANIFEST.json", outside / "MANIFEST.json")
    os.symlink(os.path.relpath(outside / "MANIFEST.json", ckpt), ckpt / "MANIFEST.json")
    refused(ckpt, "MANIFEST.json", "outside")


def test_symlink_inside_the_checkpoint_is_followed(ckpt: Path) -> None:
    name = data_files(ckpt)[0]
    (ckpt / "sub").mkdir()
    os.rename(ckpt / name, ckpt / "sub" / name)
    os.symlink(os.path.join("sub", name), ckpt / name)
    shardsafe.verify(ckpt)
    assert torch.equal(shardsafe.load(ckpt)["x"], torch.arange(40, dtype=torch.float32).reshape(10, 4))


def test_manifest_symlinked_to_dev_zero(ckpt: Path) -> None:
    """Refused before reading a byte (a capped read is not enough: /dev/zero is not a file)."""
    (ckpt / "MANIFEST.json").unlink()
    os.symlink("/dev/zero", ckpt / "MANIFEST.json")
    with memory_cap(256 * 2**20):
        refused(ckpt, "MANIFEST.json", "not a regular file")


def test_oversized_manifest_is_not_read(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDSAFE_MAX_MANIFEST_BYTES", "1000")
    refused(ckpt, "MANIFEST.json", "SHARDSAFE_MAX_MANIFEST_BYTES")


def test_sparse_file_with_a_forged_shape_is_not_allocated(ckpt: Path) -> None:
    """The file really is 500 GB (sparse), the manifest is consistent with it: only the memory
    available stops ``load(path)`` from allocating it."""
    name = data_files(ckpt)[0]
    size = 500 * 2**30

    def change(d: Doc) -> None:
        d["checksum"]["block_bytes"] = 2**40  # one checksum per chunk: the list stays short
        for t in d["tensors"].values():
            for c in t["chunks"]:
                c["checksums"] = [xxhash.xxh3_64_hexdigest(b"")] if c["begin"] == c["end"] else ["0" * 16]
        t = d["tensors"]["x"]
        c = t["chunks"][0]
        rows = (size - c["begin"]) // 16
        t["shape"], c["sizes"], c["end"] = [rows, 4], [rows, 4], c["begin"] + rows * 16
        d["files"][name]["size"] = c["end"]

    edit_manifest(ckpt, change)
    os.truncate(ckpt / name, manifest_of(ckpt)["files"][name]["size"])
    with memory_cap(2**30), pytest.raises(CheckpointError) as info:
        shardsafe.load(ckpt)
    assert "memory" in str(info.value) and "'x'" in str(info.value), info.value
    assert "alloc" not in str(info.value.__cause__ or ""), info.value.__cause__


# ------------------------------------------------------------------------------ bounded work


def test_one_tensor_in_many_one_element_chunks(ckpt: Path) -> None:
    """The spec allows any tiling; validating one must not be quadratic in the number of chunks (a
    pairwise check takes minutes here: the guard is a hang detector, not a timing)."""
    n = 40_000
    name = data_files(ckpt)[0]
    values = torch.arange(n, dtype=torch.float32).numpy().tobytes()
    with open(ckpt / name, "ab") as f:
        f.write(values)

    def change(d: Doc) -> None:
        start = d["files"][name]["size"]
        chunks = [
            {
                "offsets": [0, i],
                "sizes": [1, 1],
                "file": name,
                "key": f"wide@0,{i}" if i else "wide",
                "begin": start + 4 * i,
                "end": start + 4 * i + 4,
                "checksums": [xxhash.xxh3_64_hexdigest(values[4 * i : 4 * i + 4])],
                "digest": xxhash.xxh3_128_hexdigest(values[4 * i : 4 * i + 4]),
                "ref": None,
            }
            for i in range(n)
        ]
        d["tensors"]["wide"] = {"dtype": "float32", "shape": [1, n], "chunks": chunks}
        d["objects"]["wide"] = {"kind": "value", "value": {"$": "tensor", "ref": "wide"}}
        d["files"][name]["size"] = start + 4 * n

    edit_manifest(ckpt, change)
    with guard(60):
        info = shardsafe.inspect(ckpt)
    assert [e.chunks for e in info.entries if e.name == "wide" and e.kind == "tensor"] == [n]


def test_overlap_anywhere_in_a_grid_is_found(ckpt: Path) -> None:
    """A 2-D tiling of one-element chunks with one duplicate and one hole: the element count still
    matches, the overlap must be found."""
    n = 30

    def change(d: Doc) -> None:
        c = chunk_of(d, "x")
        t = d["tensors"]["x"]
        t["shape"] = [n, n]
        chunks = []
        for i in range(n):
            for j in range(n):
                chunks.append({**c, "offsets": [i, j], "sizes": [1, 1], "end": c["begin"] + 4})
        chunks[-1]["offsets"] = [0, 0]  # [n-1, n-1] never covered, [0, 0] twice
        for ch in chunks:
            ch["checksums"] = [xxhash.xxh3_64_hexdigest(b"\0" * 4)]
        t["chunks"] = chunks

    edit_manifest(ckpt, change)
    refused(ckpt, "MANIFEST.json", "'x'", "overlap", readers=("inspect",))


# ------------------------------------------------------------ every entry point, every escape


def test_malformed_optimizer_entry_raises_a_checkpoint_error(ckpt: Path) -> None:
    edit_manifest(ckpt, lambda d: d["objects"]["optim"].update(value={"$": "dict", "items": [["state", 5]]}))
    with pytest.raises(CheckpointError) as info:
        shardsafe.load(ckpt, fresh_state())
    assert "optim" in str(info.value)


def _break_manifest_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in for a bug anywhere below the entry points."""
    import shardsafe.engine.read as read_module

    def broken(*_: Any, **__: Any) -> Any:
        raise ZeroDivisionError("stand-in\nfor an unforeseen failure")

    monkeypatch.setattr(read_module, "parse_manifest", broken)


@pytest.mark.parametrize("entry", ["load", "load(state)", "verify", "inspect"])
def test_unexpected_errors_become_checkpoint_errors(ckpt: Path, monkeypatch: pytest.MonkeyPatch, entry: str) -> None:
    """Whatever escapes the readers reaches the caller as a CheckpointError naming the path, with the
    original as its cause."""
    _break_manifest_parsing(monkeypatch)
    with pytest.raises(CheckpointError) as info:
        manifest_readers(ckpt)[entry]()
    assert str(ckpt) in str(info.value)
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_cli_reports_any_failure_in_one_line(
    ckpt: Path, pristine: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = manifest_of(ckpt)
    doc["objects"]["step"]["value"] = PLACEHOLDER
    write_raw_manifest(ckpt, doc, deep_list(100_000))
    for command in (["verify"], ["inspect"], ["inspect", "--json"]):
        assert cli([*command, str(ckpt)]) == 1
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and "Traceback" not in err, err
        assert str(ckpt) in err
    _break_manifest_parsing(monkeypatch)
    for command in (["verify", str(pristine)], ["inspect", str(pristine)], ["ls", "--verify", str(pristine.parent)]):
        assert cli(command) == 1
        out, err = capsys.readouterr()
        assert err.count("\n") == 1 and "Traceback" not in err and "stand-in" in err, err


def test_manager_resume_maps_unexpected_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "run"
    with shardsafe.CheckpointManager(root) as manager:
        manager.save(5, {"x": torch.ones(2)})
    _break_manifest_parsing(monkeypatch)
    with shardsafe.CheckpointManager(root) as manager, pytest.raises(CheckpointError) as info:
        manager.resume({"x": torch.zeros(2)})
    assert "stand-in" in str(info.value)


def test_storage_refuses_files_that_are_not_regular(tmp_path: Path, fifos: list[Path]) -> None:
    """Whatever the caller: nothing that could block or stream forever is opened."""
    from shardsafe.storage import LocalStorage

    st = LocalStorage()
    os.mkfifo(tmp_path / "fifo")
    fifos.append(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    os.symlink("/dev/zero", tmp_path / "zero")
    with guard(60):
        for name in ("fifo", "dir", "zero"):
            path = str(tmp_path / name)
            calls: list[Callable[[], object]] = [
                lambda p=path: st.read_bytes(p),
                lambda p=path: st.size(p),
                lambda p=path: st.read_into(p, 0, memoryview(bytearray(1))),
            ]
            for call in calls:
                with pytest.raises(CorruptCheckpointError, match="not a regular file"):
                    call()


def test_fsspec_backend_refuses_files_that_are_not_regular(pristine: Path, tmp_path: Path, fifos: list[Path]) -> None:
    """The same rules through fsspec: ``file://`` (a FIFO, a symlink out, /dev/zero as the manifest)
    and an object store, here ``memory://`` (a prefix in place of an object, an oversized manifest)."""
    import fsspec

    from shardsafe.storage.remote import FsspecStorage

    local = tmp_path / "ckpt"
    local.mkdir()
    for f in pristine.iterdir():
        (local / f.name).write_bytes(f.read_bytes())
    name = data_files(local)[0]
    url = f"file://{local}"
    (local / name).unlink()
    os.mkfifo(local / name)
    fifos.append(local / name)
    with guard(60):
        for read in (lambda: shardsafe.verify(url), lambda: shardsafe.load(url)):
            with pytest.raises(CorruptCheckpointError, match="not a regular file"):
                read()
    (local / name).unlink()
    os.symlink(pristine / name, local / name)
    with pytest.raises(CorruptCheckpointError, match="outside"):
        shardsafe.verify(url)
    (local / "MANIFEST.json").unlink()
    os.symlink("/dev/zero", local / "MANIFEST.json")
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        shardsafe.inspect(url)

    memory = fsspec.filesystem("memory")
    prefix = f"/hostile-{os.getpid()}"
    for f in pristine.iterdir():
        memory.pipe_file(f"{prefix}/{f.name}", f.read_bytes())
    memory.rm_file(f"{prefix}/{name}")
    memory.pipe_file(f"{prefix}/{name}/inner", b"x" * 100)
    try:
        with pytest.raises(CorruptCheckpointError, match=name):  # its size is that of what the prefix holds
            shardsafe.verify(f"memory://{prefix}")
        with pytest.raises(CorruptCheckpointError, match="not a regular file"):
            FsspecStorage("memory").read_into(f"memory://{prefix}/{name}", 0, memoryview(bytearray(8)))
        os.environ["SHARDSAFE_MAX_MANIFEST_BYTES"] = "100"
        with pytest.raises(CorruptCheckpointError, match="SHARDSAFE_MAX_MANIFEST_BYTES"):
            shardsafe.inspect(f"memory://{prefix}")
    finally:
        os.environ.pop("SHARDSAFE_MAX_MANIFEST_BYTES", None)
        memory.rm(prefix, recursive=True)


def test_writer_refuses_what_readers_reject(tmp_path: Path) -> None:
    """A save never writes a checkpoint that its own reader would refuse: values nested too deep (or
    holding themselves), numpy scalars outside the table, negative sizes."""
    import numpy as np

    from shardsafe import UnsafeValueError

    deep: list[Any] = []
    for _ in range(150):
        deep = [deep]
    looped: list[Any] = []
    looped.append(looped)
    for value, words in [
        (deep, "levels deep"),
        (looped, "levels deep"),
        (np.longdouble(1.5), "longdouble"),
        (torch.Size([2, -1]), "negative"),
    ]:
        with pytest.raises(UnsafeValueError, match=words):
            shardsafe.save(tmp_path / "ck", {"v": value})
        assert not (tmp_path / "ck").exists()
    shardsafe.save(tmp_path / "ok", {"v": {"a": {"b": [[(1, 2)]]}}, "n": np.uint64(2**64 - 1)})
    assert shardsafe.load(tmp_path / "ok")["n"] == np.uint64(2**64 - 1)


def test_tensors_in_dicts_at_the_depth_limit_are_written_only_as_deep_as_readers_read(tmp_path: Path) -> None:
    """The writer encodes a dict's tensors without a call of its own (the common case of a state dict):
    one nested one level past the limit is still refused by name, and every one it wrote loads."""
    from shardsafe import UnsafeValueError

    outcomes = set()
    for depth in range(28, 40):
        value: Any = torch.full((2,), float(depth))
        for _ in range(depth):
            value = {"k": value}
        path = tmp_path / f"d{depth}"
        try:
            shardsafe.save(path, {"v": value})
        except UnsafeValueError as err:
            assert "nests more than" in str(err), err  # the encoder's words, naming the value (not the manifest)
            assert not path.exists()
            outcomes.add("refused")
            continue
        loaded = shardsafe.load(path)["v"]
        for _ in range(depth):
            loaded = loaded["k"]
        assert torch.equal(loaded, torch.full((2,), float(depth)))
        assert "refused" not in outcomes, f"depth {depth} written after a shallower one was refused"
        outcomes.add("written")
    assert outcomes == {"written", "refused"}
