"""The ``shardsafe`` command as a shell user meets it: ``--help`` (of the command and of each subcommand)
and ``--version`` import neither torch nor the other heavy packages, so they answer at once; a reader
that goes away (``shardsafe inspect ... | head -1``) is no failure (exit 0, nothing on stderr); the
description names every command; an export's bar starts only once there is work to show (never
``0 B of 0 B (100%)``)."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.cli import main

HEAVY = ("torch", "numpy", "safetensors", "fsspec", "transformers", "lightning", "xxhash")
"""Packages ``--help`` must not import (each costs from tens of milliseconds to seconds)."""

HELP_ARGS = [
    ["--help"],
    ["--version"],
    ["inspect", "--help"],
    ["verify", "--help"],
    ["ls", "--help"],
    ["export", "--help"],
    ["import", "--help"],
]


def _imported(stderr: str) -> set[str]:
    """Top-level packages named in ``-X importtime`` output."""
    names = set()
    for line in stderr.splitlines():
        m = re.match(r"import time:\s+\d+\s+\|\s+\d+\s+\|\s+(\S+)", line)
        if m:
            names.add(m.group(1).split(".")[0])
    return names


@pytest.mark.parametrize("args", HELP_ARGS, ids=lambda a: " ".join(a))
def test_help_imports_nothing_heavy(args: list[str]) -> None:
    run = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "shardsafe", *args], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip(), "nothing printed"
    heavy = _imported(run.stderr) & set(HEAVY)
    assert not heavy, f"`shardsafe {' '.join(args)}` imported {sorted(heavy)}"


@pytest.mark.parametrize("command", ["inspect", "verify", "ls"])
def test_a_path_where_nothing_is_is_said_without_importing_torch(command: str, tmp_path: Path) -> None:
    """A typo in the path used to cost seconds (torch and the engine imported) before "nothing is there"."""
    missing = str(tmp_path / "no-such-run")
    run = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "shardsafe", command, missing],
        capture_output=True,
        text=True,
        timeout=120,
    )
    heavy = _imported(run.stderr) & set(HEAVY)
    assert not heavy, f"`shardsafe {command} MISSING` imported {sorted(heavy)}"
    said = [line for line in run.stderr.splitlines() if not line.startswith("import time:")]
    if command == "ls":
        assert run.returncode == 2 and said == [
            f"shardsafe ls: {missing!r} does not exist; give the directory that holds the checkpoints"
        ], said
        return
    with pytest.raises(shardsafe.CheckpointNotFoundError) as raised:  # the library's own words
        shardsafe.inspect(missing)
    assert run.returncode == 1 and said == [f"shardsafe {command}: NOT A CHECKPOINT: {raised.value}"], said


def test_installed_script_help_imports_no_torch() -> None:
    script = Path(sys.executable).parent / "shardsafe"
    assert script.exists(), f"{script} missing: install the package with `pip install -e .`"
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    run = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0 and "usage: shardsafe" in run.stdout, run.stderr[-2000:]
    assert not _imported(run.stderr) & set(HEAVY)


def test_import_shardsafe_alone_imports_no_torch_and_the_api_still_resolves() -> None:
    code = (
        "import sys, shardsafe\n"
        "assert 'torch' not in sys.modules, 'import shardsafe imported torch'\n"
        "assert issubclass(shardsafe.CorruptCheckpointError, shardsafe.CheckpointError)\n"
        "assert 'torch' not in sys.modules\n"
        "from shardsafe import save, export_hf\nfrom shardsafe.runtime import Runtime\n"
        "assert save is shardsafe.save and callable(export_hf) and 'torch' in sys.modules\n"
        "assert shardsafe.engine.api.save is save  # subpackages as before\n"
        "assert shardsafe.storage.local.LocalStorage is not None\n"
        "assert set(shardsafe.__all__) <= set(dir(shardsafe))\n"
        "try:\n"
        "    shardsafe.no_such_name\n"
        "except AttributeError as err:\n"
        "    assert 'no_such_name' in str(err)\n"
        "else:\n"
        "    raise AssertionError('no AttributeError')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


def test_every_public_name_resolves() -> None:
    for name in shardsafe.__all__:
        assert getattr(shardsafe, name) is not None, name


def test_description_names_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    description = out.split("\n\n")[1].lower()
    for word in ("inspect", "verify", "list", "export", "import"):
        assert word in description, (word, description)


# ------------------------------------------------------------------------------ closed pipes


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """A committed checkpoint whose ``inspect`` output is long (a few hundred entries)."""
    path = tmp_path / "run" / "step-1"
    shardsafe.save(path, {f"layer{i}.weight": torch.zeros(2, dtype=torch.float16) for i in range(300)})
    return path


def _with_closed_stdout(args: list[str]) -> subprocess.CompletedProcess[str]:
    """Run ``python -m shardsafe ARGS`` with stdout a pipe whose reader has already gone away (what
    ``| head -1`` leaves once head has its line)."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [sys.executable, "-m", "shardsafe", *args],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)


@pytest.mark.parametrize(
    "args",
    [["inspect", "{ckpt}"], ["inspect", "--json", "{ckpt}"], ["verify", "{ckpt}"], ["ls", "{root}"], ["--help"]],
    ids=lambda a: " ".join(a),
)
def test_a_reader_that_goes_away_is_no_failure(ckpt: Path, args: list[str]) -> None:
    argv = [a.format(ckpt=ckpt, root=ckpt.parent) for a in args]
    run = _with_closed_stdout(argv)
    assert run.returncode == 0, run.stderr
    assert run.stderr == "", run.stderr


def test_head_dash_1(ckpt: Path) -> None:
    """The shell pipeline itself: head's exit and shardsafe's are both 0, only head's line shows."""
    cmd = f"set -o pipefail; '{sys.executable}' -m shardsafe inspect '{ckpt}' | head -1"
    run = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("checkpoint:") and run.stdout.count("\n") == 1 and run.stderr == ""


def test_a_corrupt_checkpoint_still_exits_1_when_stdout_is_gone(ckpt: Path) -> None:
    data = next(ckpt.glob("data-*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    run = _with_closed_stdout(["verify", str(ckpt)])
    assert run.returncode == 1 and "CORRUPT" in run.stderr, run.stderr


# -------------------------------------------------------------------------------- export's bar


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "log"])
def test_export_bar_starts_only_when_there_is_work(
    tmp_path: Path, terminal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planning an export (reading the manifest, asking transformers which weights are tied) can take
    seconds before the first byte: the bar says nothing until the total is known, rather than
    ``0 B of 0 B (100%)``."""
    import shardsafe.interop.hf as hf

    shardsafe.save(tmp_path / "ck", {"model": torch.nn.Linear(64, 64)})
    plan = hf.plan_shards

    def slow_plan(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.4)  # several progress intervals before the total is known
        return plan(*args, **kwargs)

    monkeypatch.setattr(hf, "plan_shards", slow_plan)
    monkeypatch.setenv("SHARDSAFE_PROGRESS_INTERVAL", "0.05")
    monkeypatch.setenv("SHARDSAFE_FAULT", "")
    err = _Tty() if terminal else io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    assert main(["export", str(tmp_path / "ck"), str(tmp_path / "hf")]) == 0
    text = err.getvalue()
    assert "0 B/0 B" not in text and "0 B of 0 B" not in text, text
    if terminal:  # the final record still ends the bar
        assert re.search(r"100%.* done in \d+:\d\d *\n$", text), text


def test_bar_skips_records_before_the_total_is_known() -> None:
    from shardsafe import Progress, ProgressBar

    def record(**kw: Any) -> Progress:
        base: dict[str, Any] = dict(
            op="export", path="/ck", phase="manifest", done_bytes=0, total_bytes=0, seconds=3.0, ranks=1
        )
        base.update(ranks_reporting=1, slowest_rank=0, slowest_fraction=1.0)
        base.update(kw)
        return Progress(**base)

    for stream in (_Tty(), io.StringIO()):
        bar = ProgressBar(stream)
        bar(record())
        assert stream.getvalue() == ""
        bar(record(phase="write", done_bytes=10, total_bytes=100, slowest_fraction=0.1))
        assert "10 B" in stream.getvalue()
