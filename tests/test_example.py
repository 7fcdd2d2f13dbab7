"""The example training run (examples/train.py, what `make run` runs), at a reduced size: a rank is
killed mid-run, the next invocation resumes from the last committed checkpoint, and the final state
equals an uninterrupted run's bit for bit."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import torch

import shardsafe

from models import FSDP2_ON_CPU_PROBLEM

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train.py"
SMALL = ["--steps", "12", "--every", "4", "--dim", "32", "--layers", "2", "--heads", "2", "--seq", "16"]
SMALL += ["--batch", "4", "--log-every", "4", "--timeout", "60"]


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("shardsafe_example_train", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_crash_resume_and_bitwise_equality(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    # The example's FSDP2 on CPU ranks, or DDP on a torch whose FSDP2 cannot run on CPU (2.6).
    strategy = "fsdp" if FSDP2_ON_CPU_PROBLEM is None else "ddp"
    cmd = [sys.executable, str(EXAMPLE), "demo", "--dir", str(tmp_path), "--crash-at-step", "7", "--strategy", strategy]
    cmd += SMALL
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "rank 1: killing myself in the middle of step 7" in out
    assert "crashed as asked: worker rank 1 was killed by signal SIGKILL" in out
    assert "resumed from the checkpoint of step 4" in out
    assert "EQUAL: all" in out and "VERDICT: resumed run == uninterrupted run, bit for bit" in out
    assert out.count("checkpoint step-00000004: ") == 2  # the crashed run and the reference
    assert out.count("checkpoint step-00000012: ") == 2  # the resumed run and the reference

    # The final states are real checkpoints, and the comparison does catch a single flipped bit.
    run, reference = tmp_path / "run", tmp_path / "reference"
    assert shardsafe.inspect(run / "final").metadata == {"step": 12}
    left, right = shardsafe.load(run / "final"), shardsafe.load(reference / "final")
    example = _example()
    assert example.same_bits(left, right)
    weight = right["model"]["head.weight"]
    weight.view(-1)[:1].view(torch.int32).bitwise_xor_(1)  # flip the lowest bit of one float
    assert not example.same_bits(left, right)
