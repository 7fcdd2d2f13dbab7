"""The ``shardsafe`` command: inspect, verify and ls, their output and exit status (0 fine, 1 corrupt or
incomplete or missing, 2 usage error), through ``main()`` and once through the installed script."""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.cli import main


def _state() -> dict[str, Any]:
    model = torch.nn.Linear(3, 2)
    return {"model": model, "emb": torch.zeros(4, 5, dtype=torch.bfloat16), "step": 12}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A checkpoint root with one committed checkpoint, ``step-12``."""
    shardsafe.save(tmp_path / "step-12", _state(), metadata={"step": 12, "note": ("a", float("nan"))})
    return tmp_path


def _corrupt(path: Path) -> str:
    manifest = json.loads((path / "MANIFEST.json").read_text())
    chunk = manifest["tensors"]["emb"]["chunks"][0]
    file = path / chunk["file"]
    raw = bytearray(file.read_bytes())
    raw[chunk["begin"]] ^= 0x10
    file.write_bytes(bytes(raw))
    return str(file)


def test_inspect_table(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = root / "step-12"
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    info = shardsafe.inspect(path)
    lines = out.splitlines()
    assert lines[0].split() == ["checkpoint:", str(path)]
    assert "format version: 3" in out and f"save id:        {info.save_id}" in out
    assert "world size:     1" in out and "strategy:       plain" in out
    assert f"total size:     {info.total_bytes} bytes in 1 data file(s)" in out
    assert 'metadata:       {"step": 12, "note": ["a", "nan"]}' in out
    table = lines[lines.index("") + 1 :]
    assert table[0].split() == ["NAME", "KIND", "DTYPE", "SHAPE", "CHUNKS", "BYTES"]
    rows = {tuple(line.split()[:2]): line.split() for line in table[1:]}
    assert rows[("emb", "tensor")] == ["emb", "tensor", "bfloat16", "[4,", "5]", "1", "40"]
    assert rows[("model/weight", "tensor")] == ["model/weight", "tensor", "float32", "[2,", "3]", "1", "24"]
    assert rows[("model/bias", "tensor")] == ["model/bias", "tensor", "float32", "[2]", "1", "8"]
    assert rows[("model", "module")] == ["model", "module", "-", "-", "-", "-"]
    assert rows[("step", "value")] == ["step", "value", "-", "-", "-", "-"]


def test_inspect_json(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = root / "step-12"
    assert main(["inspect", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    info = shardsafe.inspect(path)
    assert doc["path"] == str(path) and doc["format_version"] == 3 and doc["save_id"] == info.save_id
    assert doc["created"] == info.created and doc["world_size"] == 1 and doc["strategy"] == "plain"
    assert doc["total_bytes"] == info.total_bytes and doc["files"] == info.files
    assert doc["metadata"] == {"step": 12, "note": ["a", "nan"]}
    emb = next(e for e in doc["entries"] if e["name"] == "emb" and e["kind"] == "tensor")
    assert emb == {"name": "emb", "kind": "tensor", "dtype": "bfloat16", "shape": [4, 5], "chunks": 1, "nbytes": 40}


def test_verify_ok(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = root / "step-12"
    assert main(["verify", str(path)]) == 0
    captured = capsys.readouterr()
    summary = shardsafe.verify(path)
    assert captured.out == f"OK {path}: 1 data file(s), 3 tensor(s), {summary.bytes} bytes verified\n"
    assert captured.err == ""


def test_verify_corrupt(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    file = _corrupt(root / "step-12")
    assert main(["verify", str(root / "step-12")]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith("shardsafe verify: CORRUPT: ") and file in line and "'emb'" in line


def test_verify_uncommitted(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (root / "step-12" / "MANIFEST.json").unlink()
    assert main(["verify", str(root / "step-12")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("shardsafe verify: NOT A CHECKPOINT: ") and "uncommitted" in err


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_missing_or_not_a_directory(tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([command, str(tmp_path / "nope")]) == 1
    assert "NOT A CHECKPOINT" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert main([command, str(tmp_path / "file")]) == 1
    assert str(tmp_path / "file") in capsys.readouterr().err


def test_inspect_bad_manifest(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (root / "step-12" / "MANIFEST.json").write_text('{"format_version": 4}')
    assert main(["inspect", str(root / "step-12")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("shardsafe inspect: CORRUPT: ") and "format_version 4" in err


@pytest.mark.parametrize(
    "argv",
    [[], ["verify"], ["inspect"], ["bogus", "x"], ["verify", "a", "b"], ["verify", ""], ["inspect", "--nope", "x"]],
)
def test_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert "usage: shardsafe" in capsys.readouterr().err


def test_help_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "inspect" in capsys.readouterr().out
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"shardsafe {shardsafe.__version__}"


def test_ls(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shardsafe.save(root / "step-20", _state(), metadata={"step": 20})
    assert main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert "step-12" in out and "step-20" in out and "committed" in out
    assert main(["ls", str(root), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(c["name"], c["status"], c["step"]) for c in doc["checkpoints"]] == [
        ("step-12", "committed", 12),
        ("step-20", "committed", 20),
    ]
    _corrupt(root / "step-20")
    assert main(["ls", str(root)]) == 0  # without --verify only manifests are read
    capsys.readouterr()
    assert main(["ls", str(root), "--verify", "--json"]) == 1
    statuses = {c["name"]: c["status"] for c in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert statuses == {"step-12": "committed", "step-20": "corrupt"}
    assert main(["ls", str(root / "missing")]) == 2


def test_installed_script(root: Path) -> None:
    script = Path(sys.executable).parent / "shardsafe"
    assert script.exists(), f"{script} missing: install the package with `pip install -e .`"
    path = str(root / "step-12")
    _corrupt(root / "step-12")
    run = subprocess.run([str(script), "verify", path], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr
    assert run.stdout == "" and "CORRUPT" in run.stderr and "'emb'" in run.stderr


def test_python_dash_m(root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["shardsafe", "verify", str(root / "step-12")])
    monkeypatch.delitem(sys.modules, "shardsafe.__main__", raising=False)
    with pytest.raises(SystemExit) as stop:
        runpy.run_module("shardsafe", run_name="__main__")
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith(f"OK {root / 'step-12'}: ")


def test_refusals_name_the_command_s_flags_not_the_library_s_keywords(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``shardsafe import`` into a committed checkpoint said "pass overwrite=True", a keyword the command
    has no way to pass; it says ``--overwrite``."""
    src = tmp_path / "model.pt"
    torch.save(torch.nn.Linear(3, 2).state_dict(), src)
    assert main(["import", str(src), str(tmp_path / "dest")]) == 0
    capsys.readouterr()
    assert main(["import", str(src), str(tmp_path / "dest")]) == 1
    err = capsys.readouterr().err
    assert "--overwrite" in err and "overwrite=" not in err, err
    assert main(["import", str(src), str(tmp_path / "dest"), "--overwrite"]) == 0
    assert main(["export", str(tmp_path / "dest"), str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    assert main(["export", str(tmp_path / "dest"), str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err
    assert "--overwrite" in err and "overwrite=" not in err, err
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert main(["import", str(src), str(foreign), "--overwrite"]) == 1
    err = capsys.readouterr().err
    assert "whatever --overwrite says" in err and "overwrite=" not in err, err
