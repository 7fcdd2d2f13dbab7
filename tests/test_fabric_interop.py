"""shardsafe inside a Lightning Fabric script: Fabric launches 2 processes (its DDP strategy on CPU),
the script saves with shardsafe.save on every rank, and a second launch resumes with shardsafe.load
and ends exactly where an uninterrupted run ends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardsafe

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import hashlib, json, sys
    import torch
    from torch import nn
    import lightning as L
    import shardsafe


    def digest(model):
        h = hashlib.sha256()
        for name, p in sorted(model.state_dict().items()):
            h.update(name.encode())
            h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()


    def main(phase, path):
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
        fabric.launch()
        fabric.seed_everything(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        model, opt = fabric.setup(model, opt)
        state = {"model": model, "optim": opt, "step": 0}
        if phase == "resume":
            shardsafe.load(path, state)
        resumed_at = state["step"]
        for step in range(resumed_at + 1, 7):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
            loss = model(x[fabric.global_rank :: fabric.world_size]).pow(2).mean()
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            state["step"] = step
            if phase == "first" and step == 3:
                shardsafe.save(path, state)  # every rank calls; shardsafe decides who writes
        out = {"rank": fabric.global_rank, "resumed_at": resumed_at, "step": state["step"], "digest": digest(model)}
        with open(f"{path}-{phase}-rank{fabric.global_rank}.json", "w") as f:  # not stdout: lines may interleave
            json.dump(out, f)
        # an orderly teardown: gloo's pairs can abort the interpreter when they are destroyed at exit
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


    if __name__ == "__main__":
        main(sys.argv[1], sys.argv[2])
    """
)


def _fabric_run(script: Path, phase: str, ckpt: Path) -> list[dict[str, Any]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        [sys.executable, str(script), phase, str(ckpt)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=script.parent,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [json.loads(Path(f"{ckpt}-{phase}-rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.fixture(scope="module")
def fabric_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[dict[str, Any]]]:
    """A Fabric run of 6 steps that saved a checkpoint at step 3."""
    tmp = tmp_path_factory.mktemp("fabric")
    script = tmp / "fabric_script.py"
    script.write_text(SCRIPT)
    ckpt = tmp / "ckpt-step3"
    return script, ckpt, _fabric_run(script, "first", ckpt)


def test_fabric_script_saves_and_resumes_bit_for_bit(fabric_run: tuple[Path, Path, list[dict[str, Any]]]) -> None:
    script, ckpt, first = fabric_run
    assert [r["rank"] for r in first] == [0, 1]
    info = shardsafe.inspect(ckpt)
    assert info.world_size == 2 and {"model", "optim", "step"} <= {e.name for e in info.entries}
    shardsafe.verify(ckpt)
    resumed = _fabric_run(script, "resume", ckpt)
    assert [r["resumed_at"] for r in resumed] == [3, 3]
    assert [r["step"] for r in resumed] == [6, 6]
    assert {r["digest"] for r in resumed} == {first[0]["digest"]} == {r["digest"] for r in first}


def test_fabric_checkpoint_loads_into_a_plain_model(fabric_run: tuple[Path, Path, list[dict[str, Any]]]) -> None:
    _, ckpt, _ = fabric_run
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    state: dict[str, Any] = {"model": model, "optim": opt, "step": 0}
    shardsafe.load(ckpt, state)
    assert state["step"] == 3
    assert len(opt.state) == 4 and all(int(s["step"]) == 3 for s in opt.state.values())
