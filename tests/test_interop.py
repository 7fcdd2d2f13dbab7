"""Export and import from the attacker's and the careless user's side, in one process: what happens to
OUT (user files, a forged marker, OUT inside the checkpoint, a symlink, a crash or a kill midway, a
corrupt byte), which entry is exported under which names, and imports of hostile pickles."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.cli import main
from shardsafe.errors import CheckpointError, CheckpointExistsError, CorruptCheckpointError, UnsafeValueError
from shardsafe.interop import hf
from shardsafe.interop.hf import parse_size, plan_shards
from shardsafe.interop.outdir import MARKER

safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.ReLU(), torch.nn.Linear(30, 20))


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    model = _model()
    extra = {
        "ids": torch.arange(7, dtype=torch.int64),
        "scalar": torch.tensor(1.5),
        "empty": torch.zeros(0, 3),
        "mask": torch.tensor([True, False]),
        "nested": {"w": torch.ones(2, 2)},
        "note": "text",
    }
    shardsafe.save(tmp_path / "ckpt", {"model": model, "step": 4, "extra": extra})
    return tmp_path / "ckpt"


def _read(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (safe_open is not a dict)
    return out


def _snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _hidden(parent: Path) -> list[str]:
    return sorted(n for n in os.listdir(parent) if n.startswith("."))


# ------------------------------------------------------------------------------------------- export


def test_export_writes_the_hf_layout(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "hf"
    assert main(["export", str(ckpt), str(out), "--max-shard-size", "2KB"]) == 0
    assert "[model]" in capsys.readouterr().out
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert files == [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
    ]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    model = _model().state_dict()
    assert sorted(index["weight_map"]) == sorted(model) and index["metadata"]["total_size"] == 4 * (
        1200 + 30 + 600 + 20
    )
    weights = _read(out)
    assert all(torch.equal(weights[k], v) for k, v in model.items())
    assert sorted(os.listdir(out)) == sorted([*files, "model.safetensors.index.json", MARKER])
    assert _hidden(tmp_path) == []


def test_dtype_converts_floating_tensors_only(ckpt: Path, tmp_path: Path) -> None:
    result = shardsafe.export_hf(ckpt, tmp_path / "x", key="extra", dtype=torch.float16)
    assert result.skipped == ["note"] and result.files == ["model.safetensors"]
    got = _read(tmp_path / "x")
    assert got["ids"].dtype == torch.int64 and torch.equal(got["ids"], torch.arange(7))
    assert got["scalar"].dtype == torch.float16 and got["scalar"].shape == () and got["scalar"].item() == 1.5
    assert got["empty"].shape == (0, 3) and got["mask"].tolist() == [True, False]
    assert got["nested.w"].dtype == torch.float16


@pytest.mark.parametrize("slab", [64, 100, 4096])
def test_pieces_smaller_than_a_tensor(ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slab: int) -> None:
    monkeypatch.setenv("SHARDSAFE_CHECKSUM_BLOCK_BYTES", "64")
    shardsafe.save(tmp_path / "small-blocks", {"model": _model()})
    monkeypatch.setenv("SHARDSAFE_EXPORT_SLAB_BYTES", str(slab))
    shardsafe.export_hf(tmp_path / "small-blocks", tmp_path / "hf", dtype="bfloat16")
    got = _read(tmp_path / "hf")
    assert all(torch.equal(got[k], v.bfloat16()) for k, v in _model().state_dict().items())


def test_key_selection_and_names(ckpt: Path, tmp_path: Path) -> None:
    shardsafe.save(tmp_path / "two", {"a": _model(), "b": _model()})
    with pytest.raises(ValueError, match=r"2 module entries among: a \(module\), b \(module\).*--key"):
        shardsafe.export_hf(tmp_path / "two", tmp_path / "o1")
    with pytest.raises(ValueError, match=r"has no entry 'modle'.*model \(module\)"):
        shardsafe.export_hf(ckpt, tmp_path / "o2", key="modle")
    with pytest.raises(ValueError, match="holds no tensors"):
        shardsafe.export_hf(ckpt, tmp_path / "o3", key="step")
    with pytest.raises(ValueError, match=r"does not start with the prefix 'x\.'"):
        shardsafe.export_hf(ckpt, tmp_path / "o4", strip_prefix="x.")
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 5)) and _hidden(tmp_path) == []
    # (o5 below: exported, since a lone dict of tensors is the default entry)
    result = shardsafe.export_hf(ckpt, tmp_path / "nested", key="extra/nested")
    assert list(_read(tmp_path / "nested")) == ["w"]
    result = shardsafe.export_hf(tmp_path / "two", tmp_path / "all", key="/")
    assert sorted(_read(tmp_path / "all")) == sorted(f"{k}.{n}" for k in "ab" for n in _model().state_dict())
    result = shardsafe.export_hf(tmp_path / "two", tmp_path / "b", key="b")
    assert result.key == "b" and sorted(_read(tmp_path / "b")) == sorted(_model().state_dict())
    shardsafe.save(tmp_path / "wrapped", {"model": {"model.0.weight": torch.ones(1), "model.0.bias": torch.ones(1)}})
    # no module entry: the one dict of tensors is taken (an imported state dict); its shared prefix warned about
    assert shardsafe.export_hf(tmp_path / "wrapped", tmp_path / "o5").key == "model"
    shardsafe.export_hf(tmp_path / "wrapped", tmp_path / "stripped", key="model", strip_prefix="model.")
    assert sorted(_read(tmp_path / "stripped")) == ["0.bias", "0.weight"]


def test_hostile_names_print_as_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    evil = "a\nFAKE OK\x1b[2J"
    shardsafe.save(tmp_path / "ckpt", {"x": {evil: torch.ones(1), f"{evil}v": 1}})
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--key", "x"]) == 0
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "o"), "--key", "x/nope"]) == 2
    out, err = capsys.readouterr()
    assert out.count("\n") == 1 and err.count("\n") == 1 and "\x1b" not in out + err
    assert "a | FAKE OK\\x1b[2Jv" in out and "a | FAKE OK\\x1b[2J" in err
    assert list(_read(tmp_path / "hf")) == [evil]  # the name itself is kept as saved


def test_sizes_and_shard_plan() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size(" 1.5 mb ") == 1_500_000
    assert parse_size(100) == 100
    for bad in ("5 parsecs", "-1", "0", "GB", ""):
        with pytest.raises(ValueError):
            parse_size(bad)
    sizes = {"a": 6, "b": 6, "c": 2, "d": 6, "e": 2, "f": 2, "big": 30}
    # as huggingface_hub splits: a tensor over the limit is a shard of its own, placed when it is met
    assert plan_shards(list(sizes), sizes, 10) == [["a"], ["b", "c"], ["big"], ["d", "e", "f"]]
    assert plan_shards(["big", "a"], sizes, 10) == [["big"], ["a"]]


@pytest.mark.parametrize("kind", ["user-file", "user-safetensors", "export-plus-user-file"])
def test_out_with_files_it_did_not_write_is_refused_untouched(ckpt: Path, tmp_path: Path, kind: str) -> None:
    out = tmp_path / "out"
    if kind == "export-plus-user-file":
        shardsafe.export_hf(ckpt, out)
        (out / "tokenizer.json").write_text("{}")
    else:
        out.mkdir()
        name = "notes.txt" if kind == "user-file" else "model.safetensors"
        (out / name).write_bytes(b"the user's own bytes")
    before = _snapshot(out)
    with pytest.raises(CheckpointExistsError, match="refused, nothing was changed"):
        shardsafe.export_hf(ckpt, out, overwrite=True)
    assert main(["export", str(ckpt), str(out), "--overwrite"]) == 1
    assert _snapshot(out) == before and _hidden(tmp_path) == []


def test_forged_marker_does_not_make_a_deletable_export(ckpt: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    (out / "link.safetensors").symlink_to(victim)
    for files in (["../victim"], ["link.safetensors"], ["missing.safetensors"]):
        (out / MARKER).write_text(json.dumps({"format": "shardsafe-export", "version": 1, "files": files}))
        before = _snapshot(out)
        with pytest.raises(CheckpointExistsError):
            shardsafe.export_hf(ckpt, out, overwrite=True)
        assert _snapshot(out) == before
    assert victim.read_text() == "precious" and (out / "link.safetensors").is_symlink()


def test_out_inside_the_checkpoint_symlink_or_file_is_refused(ckpt: Path, tmp_path: Path) -> None:
    before = _snapshot(ckpt)
    for out in (ckpt / "hf", ckpt, ckpt / "sub" / "deeper"):
        with pytest.raises(ValueError, match="inside the checkpoint"):
            shardsafe.export_hf(ckpt, out)
        assert main(["export", str(ckpt), str(out)]) == 2
    with pytest.raises(ValueError, match="inside the checkpoint"):
        shardsafe.export_torch(ckpt, ckpt / "model.pt")
    assert _snapshot(ckpt) == before and shardsafe.verify(ckpt).files == 1
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "file").write_text("x")
    for out in (tmp_path / "link", tmp_path / "file"):
        with pytest.raises(CheckpointExistsError):
            shardsafe.export_hf(ckpt, out)
    assert os.listdir(tmp_path / "real") == [] and (tmp_path / "file").read_text() == "x"


def test_previous_export_is_replaced_only_with_overwrite(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = shardsafe.export_hf(ckpt, out, max_shard_size="2KB")
    assert len(first.files) == 3
    with pytest.raises(CheckpointExistsError, match="pass overwrite=True"):
        shardsafe.export_hf(ckpt, out)
    second = shardsafe.export_hf(ckpt, out, overwrite=True)
    assert sorted(os.listdir(out)) == [MARKER, "model.safetensors"] and second.files == ["model.safetensors"]
    assert _hidden(tmp_path) == []
    (tmp_path / "empty").mkdir()
    shardsafe.export_hf(ckpt, tmp_path / "empty")  # an empty directory is fine
    assert "model.safetensors" in os.listdir(tmp_path / "empty")


_WRITE_SHARD = hf._write_shard


def _fail_on_second_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    real = _WRITE_SHARD
    calls = []

    def failing(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(*args, **kwargs)

    monkeypatch.setattr(hf, "_write_shard", failing)


def test_a_failure_midway_leaves_out_as_it_was(ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    shardsafe.export_hf(ckpt, out, max_shard_size="2KB")
    before = _snapshot(out)
    _fail_on_second_shard(monkeypatch)
    with pytest.raises(OSError, match="No space"):
        shardsafe.export_hf(ckpt, out, max_shard_size="2KB", overwrite=True)
    _fail_on_second_shard(monkeypatch)
    with pytest.raises(OSError, match="No space"):
        shardsafe.export_hf(ckpt, tmp_path / "new", max_shard_size="2KB")
    assert _snapshot(out) == before and not (tmp_path / "new").exists() and _hidden(tmp_path) == []


def test_a_kill_midway_leaves_no_export_that_looks_complete(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    pid = os.fork()
    if pid == 0:  # the child dies (as by kill -9) while writing the second shard
        try:
            real, calls = hf.write_all, []

            def dying(fd: int, data: memoryview) -> None:
                calls.append(1)
                if len(calls) == 3:
                    os._exit(9)
                real(fd, data)

            hf.write_all = dying  # type: ignore[assignment]
            shardsafe.export_hf(ckpt, out, max_shard_size="2KB")
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 9
    assert not out.exists()  # nothing under OUT's name; the staging directory is hidden litter
    assert [n.split(".export-")[0] for n in _hidden(tmp_path)] == [".out"]
    shardsafe.export_hf(ckpt, out, max_shard_size="2KB")  # a retry is not confused by it
    assert len(_read(out)) == 4


def test_a_corrupt_byte_stops_the_export(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = json.loads((ckpt / "MANIFEST.json").read_text())
    chunk = manifest["tensors"]["model/2.weight"]["chunks"][0]
    data = ckpt / chunk["file"]
    raw = bytearray(data.read_bytes())
    raw[chunk["begin"] + 5] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match=r"checksum mismatch in tensor 'model/2.weight'"):
        shardsafe.export_hf(ckpt, tmp_path / "out")
    assert main(["export", str(ckpt), str(tmp_path / "out"), "--format", "torch"]) == 1
    assert str(data) in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and _hidden(tmp_path) == []


def test_torch_format(ckpt: Path, tmp_path: Path) -> None:
    file = tmp_path / "m.pt"
    shardsafe.export_torch(ckpt, file, key="extra", dtype="bfloat16")
    got = torch.load(file, weights_only=True)
    assert got["note"] == "text" and got["nested"]["w"].dtype == torch.bfloat16 and got["ids"].dtype == torch.int64
    with pytest.raises(CheckpointExistsError):
        shardsafe.export_torch(ckpt, file)
    assert main(["export", str(ckpt), str(file), "--format", "torch", "--overwrite"]) == 2  # never replaced
    assert main(["export", str(ckpt), str(tmp_path / "o"), "--allow-pickle"]) == 2  # hf decodes no values
    assert _hidden(tmp_path) == [] and not (tmp_path / "o").exists()


def test_export_from_an_object_store_url(tmp_path: Path) -> None:
    pytest.importorskip("fsspec")
    url = f"memory://interop-{os.getpid()}/ckpt"
    shardsafe.save(url, {"model": _model()})
    shardsafe.export_hf(url, tmp_path / "hf")
    assert all(torch.equal(_read(tmp_path / "hf")[k], v) for k, v in _model().state_dict().items())
    with pytest.raises(ValueError, match="local directory"):
        shardsafe.export_hf(url, url + "-hf")


# ------------------------------------------------------------------------------------------- import


class _Touch:
    """Unpickling this creates a file: proof that code from the file ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (Path.touch, (self.path,))


def test_import_refuses_a_pickle_payload(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    proof = tmp_path / "code-ran"
    src = tmp_path / "evil.pt"
    torch.save({"weight": torch.ones(2), "payload": _Touch(proof)}, src)
    assert main(["import", str(src), str(tmp_path / "dest")]) == 2
    err = capsys.readouterr().err
    assert "REFUSED" in err and "--allow-pickle" in err and str(src) in err
    with pytest.raises(UnsafeValueError):
        shardsafe.import_checkpoint(src, tmp_path / "dest")
    assert not proof.exists() and not (tmp_path / "dest").exists()
    dcp = tmp_path / "dcp"
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(pickle.dumps(_Touch(proof)))
    assert main(["import", str(dcp), str(tmp_path / "dest")]) == 2
    assert "DCP" in capsys.readouterr().err
    assert not proof.exists() and not (tmp_path / "dest").exists()


def test_import_with_allow_pickle_keeps_pickled_values_behind_the_same_opt_in(tmp_path: Path) -> None:
    import argparse

    src = tmp_path / "args.pt"
    torch.save({"weight": torch.ones(2), "args": argparse.Namespace(lr=0.1)}, src)
    result = shardsafe.import_checkpoint(src, tmp_path / "dest", allow_pickle=True)
    assert result.keys == ["weight", "args"]
    with pytest.raises(CheckpointError, match="holds a pickled value"):
        shardsafe.load(tmp_path / "dest")
    assert shardsafe.load(tmp_path / "dest", allow_pickle=True)["args"].lr == 0.1


def test_import_edge_cases(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "list.pt"
    torch.save([torch.arange(3), {"a": 1}], src)
    result = shardsafe.import_checkpoint(src, tmp_path / "wrapped")
    assert result.wrapped and result.keys == ["state"]
    loaded = shardsafe.load(tmp_path / "wrapped")["state"]
    assert torch.equal(loaded[0], torch.arange(3)) and loaded[1] == {"a": 1}
    with pytest.raises(CheckpointExistsError):
        shardsafe.import_checkpoint(src, tmp_path / "wrapped")
    assert main(["import", str(tmp_path / "missing.pt"), str(tmp_path / "d1")]) == 1
    assert main(["export", str(tmp_path / "no-ckpt"), str(tmp_path / "d1")]) == 1  # nothing to export
    (tmp_path / "garbage.pt").write_bytes(b"\x00not a torch file" * 10)
    assert main(["import", str(tmp_path / "garbage.pt"), str(tmp_path / "d2")]) == 1  # damage, not a pickle to allow
    err = capsys.readouterr().err
    assert "not a torch.save file" in err and "allow-pickle" not in err
    assert main(["import", str(tmp_path / "garbage.pt"), str(tmp_path / "d2"), "--allow-pickle"]) == 1
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"")
    with pytest.raises(ValueError, match="inside the source"):
        shardsafe.import_checkpoint(tmp_path / "dcp", tmp_path / "dcp" / "in", allow_pickle=True)
    (tmp_path / "folder").mkdir()
    assert main(["import", str(tmp_path / "folder"), str(tmp_path / "d3")]) == 1
    assert "not a DCP checkpoint" in capsys.readouterr().err
    assert not any((tmp_path / d).exists() for d in ("d1", "d2", "d3"))
