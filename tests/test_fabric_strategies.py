"""``shardsafe.fabric`` strategies inside real Lightning Fabric scripts: Fabric launches 2 CPU processes
with ``shardsafe.fabric.DDPStrategy`` and the script uses only ``fabric.save``/``fabric.load``/
``fabric.load_raw``. One launch covers: save on every rank, load restoring model and optimizer bitwise,
the remainder, ``filter=`` with strict and non-strict loads, ``load_raw``, a load of everything, a
``torch.save`` file refused, and a ``fabric.save`` under ``if fabric.global_rank == 0:`` raising
RankTimeoutError naming rank 1 (instead of the hang Fabric users reported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import shardsafe

pytest.importorskip("lightning")

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import hashlib, json, os, sys, time
    import torch
    from torch import nn
    import lightning as L
    import shardsafe
    import shardsafe.fabric


    def digest(model, opt=None):
        h = hashlib.sha256()
        tensors = sorted(model.state_dict().items())
        if opt is not None:
            for i, st in sorted(opt.state_dict()["state"].items()):
                tensors += [(f"opt{i}/{k}", v) for k, v in sorted(st.items())]
        for name, t in tensors:
            h.update(name.encode())
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()


    def fresh(fabric, seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        return fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=0.1))


    def main(root):
        strategy = shardsafe.fabric.DDPStrategy(checkpoint_timeout=120)
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
        fabric.launch()
        rank = fabric.global_rank
        model, opt = fresh(fabric, 0)
        for step in range(3):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
            fabric.backward(model(x[rank::2]).pow(2).mean())
            opt.step()
            opt.zero_grad()
        out = {"rank": rank}
        state = {"model": model, "optim": opt, "step": 3, "extra": {"note": "kept"}}
        fabric.save(f"{root}/full", state)  # every rank, as Fabric asks
        out["saved"] = digest(model, opt)

        m2, o2 = fresh(fabric, 1)
        asked = {"model": m2, "optim": o2, "step": 0}
        remainder = fabric.load(f"{root}/full", asked)
        out["restored"] = digest(m2, o2)
        out["step"] = asked["step"]
        out["remainder"] = remainder

        fabric.save(f"{root}/filtered", {"model": model, "optim": opt}, filter={"model": lambda k, v: "bias" not in k})
        m3, o3 = fresh(fabric, 2)
        before = {k: v.clone() for k, v in m3.state_dict().items()}
        try:
            fabric.load(f"{root}/filtered", {"model": m3})
        except shardsafe.MissingKeysError as err:
            out["filtered_strict"] = sorted(err.missing)
        out["filtered_untouched"] = all(torch.equal(before[k], v) for k, v in m3.state_dict().items())
        rest = fabric.load(f"{root}/filtered", {"model": m3}, strict=False)
        out["filtered_rest"] = sorted(rest)
        sd, ref = m3.state_dict(), model.state_dict()
        out["filtered_weights"] = all(torch.equal(sd[k], ref[k]) for k in sd if "weight" in k)
        out["filtered_bias_kept"] = all(torch.equal(sd[k], before[k]) for k in sd if "bias" in k)

        m4, _ = fresh(fabric, 3)
        fabric.load_raw(f"{root}/full", m4)
        out["raw"] = digest(m4) == digest(model)
        whole = fabric.load(f"{root}/full")
        out["whole"] = [sorted(whole), whole["step"], sorted(whole["model"])]
        if rank == 0:
            torch.save(model.state_dict(), f"{root}/plain.pt")
        fabric.barrier()
        try:
            fabric.load(f"{root}/plain.pt", {"model": m4})
        except shardsafe.CheckpointNotFoundError as err:
            out["pickle_refused"] = "never unpickles" in str(err)

        fabric.strategy.checkpoint_timeout = float(os.environ["GUARD_TIMEOUT"])  # raise soon, not after 120 s
        if rank == 0:  # the mistake Fabric users make: save on rank 0 only
            try:
                fabric.save(f"{root}/guarded", state)
            except shardsafe.RankTimeoutError as err:
                out["guard"] = [type(err).__name__, err.missing_ranks, str(err)]
        with open(f"{root}/rank{rank}.json", "w") as f:
            json.dump(out, f)
        # an orderly teardown: a rank that exits while another is still in the guarded save above can
        # abort in gloo's teardown ("terminate called without an active exception")
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


    if __name__ == "__main__":
        main(sys.argv[1])
    """
)


def test_fabric_ddp_strategy_makes_fabric_save_and_load_safe(tmp_path: Path) -> None:
    script = tmp_path / "fabric_script.py"
    script.write_text(SCRIPT)
    root = tmp_path / "ckpts"
    root.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"), "GUARD_TIMEOUT": "4"}
    proc = subprocess.run(
        [sys.executable, str(script), str(root)], capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r: list[dict[str, Any]] = [json.loads((root / f"rank{i}.json").read_text()) for i in (0, 1)]
    for out in r:
        assert out["restored"] == out["saved"] == r[0]["saved"], out  # model and optimizer, bitwise
        assert out["step"] == 3 and out["remainder"] == {"extra": {"note": "kept"}}
        assert out["filtered_strict"] == ["model/0.bias", "model/2.bias"], out
        assert out["filtered_untouched"] and out["filtered_weights"] and out["filtered_bias_kept"]
        assert out["filtered_rest"] == []  # the optimizer it did not ask for is not read (docs/loading.md)
        assert out["raw"] and out["pickle_refused"]
        assert out["whole"] == [["extra", "model", "optim", "step"], 3, ["0.bias", "0.weight", "2.bias", "2.weight"]]
    kind, missing, message = r[0]["guard"]
    assert kind == "RankTimeoutError" and missing == [1], r[0]["guard"]
    assert "waited 4s for every rank to arrive, but ranks [1] never arrived" in message, message  # the short deadline
    assert "guard" not in r[1]
    info = shardsafe.inspect(root / "full")
    assert info.world_size == 2 and {f.split("-")[1] for f in info.files} == {"00000", "00001"}
    shardsafe.verify(root / "full")
    assert not (root / "guarded" / "MANIFEST.json").exists()


def test_import_shardsafe_does_not_import_lightning() -> None:
    code = "import sys, shardsafe; print(any(m == 'lightning' or m.startswith('lightning.') for m in sys.modules))"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stdout + out.stderr
