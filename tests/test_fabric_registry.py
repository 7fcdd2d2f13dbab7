"""``shardsafe.fabric`` as a Fabric user meets it:

- its strategies are in Fabric's strategy registry under ``shardsafe_*`` names once ``shardsafe.fabric`` is
  imported (``L.Fabric(strategy="shardsafe_ddp")``), and ``python -m shardsafe.fabric run --strategy
  shardsafe_ddp script.py`` is ``fabric run`` with those names known (Lightning loads no strategy plugins);
- in a 2-process run launched that way, a scheduler config nested in the state (Lightning's
  build-your-own-trainer example) round-trips through the scheduler's own ``state_dict``/``load_state_dict``,
  and ranks out of step are told the line of the user's script, not of ``lightning/fabric/fabric.py``;
- a ``CheckpointIO`` plugin given to a shardsafe strategy (``checkpoint_io=`` or ``plugins=``) and an
  unknown FSDP ``state_dict_type`` raise a clear error instead of being ignored."""

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

from harness import free_port

pytest.importorskip("lightning")

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from torch import nn
    import lightning as L
    import shardsafe
    import shardsafe.fabric  # registers the shardsafe_* strategies that `fabric run --strategy` names


    def build(fabric, seed):
        torch.manual_seed(seed)
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        model, opt = fabric.setup(model, opt)
        return {"model": model, "optim": opt, "scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}


    def main(root):
        fabric = L.Fabric()  # accelerator, devices and strategy from `fabric run`, which launched the processes
        fabric.strategy.checkpoint_timeout = 60
        rank = fabric.global_rank
        out = {"strategy": type(fabric.strategy).__module__ + "." + type(fabric.strategy).__name__}
        state = build(fabric, 0)
        for _ in range(5):
            fabric.backward(state["model"](torch.randn(3, 4)).sum())
            state["optim"].step()
            state["scheduler"]["scheduler"].step()
        fabric.save(f"{root}/ckpt", state)
        fresh = build(fabric, 1)
        sched = fresh["scheduler"]["scheduler"]
        fabric.load(f"{root}/ckpt", fresh)
        out["same_scheduler"] = fresh["scheduler"]["scheduler"] is sched
        out["last_epoch"] = sched.last_epoch
        out["lr"] = fresh["optim"].param_groups[0]["lr"]
        out["interval"] = fresh["scheduler"]["interval"]
        try:
            fabric.save(f"{root}/out-of-step-{rank}", state)  # OUT OF STEP
        except shardsafe.RankDesyncError as err:
            out["desync"] = str(err)
        with open(f"{root}/rank{rank}.json", "w") as f:
            json.dump(out, f)


    if __name__ == "__main__":
        main(sys.argv[1])
    """
)


def test_fabric_run_with_a_registered_shardsafe_strategy(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    root = tmp_path / "ckpts"
    root.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"), "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "shardsafe.fabric", "run", "--accelerator", "cpu", "--devices", "2"]
    command += ["--strategy", "shardsafe_ddp", "--main-port", str(free_port()), str(script), str(root)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(i for i, text in enumerate(SCRIPT.splitlines(), 1) if "# OUT OF STEP" in text)
    for rank in (0, 1):
        path = root / f"rank{rank}.json"
        assert path.exists(), proc.stdout + proc.stderr
        out: dict[str, Any] = json.loads(path.read_text())
        assert out["strategy"] == "shardsafe.fabric.DDPStrategy", out
        assert out["same_scheduler"] and out["last_epoch"] == 5 and out["lr"] == 0.25, out
        assert out["interval"] == "step", out
        desync = out["desync"]
        assert f"rank 0: save('{root}/out-of-step-0') called at {script}:{line}" in desync, desync
        assert f"rank 1: save('{root}/out-of-step-1') called at {script}:{line}" in desync, desync
        assert "lightning" not in desync, desync
    shardsafe.verify(root / "ckpt")


def test_shardsafe_strategies_are_in_fabrics_registry() -> None:
    import lightning as L
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    import shardsafe.fabric

    names = set(STRATEGY_REGISTRY.available_strategies())
    assert {"shardsafe_ddp", "shardsafe_ddp_spawn", "shardsafe_fsdp"} <= names, sorted(names)
    assert not any(n.startswith("shardsafe_") and "model_parallel" in n for n in names)  # needs parallelize_fn
    assert isinstance(STRATEGY_REGISTRY.get("shardsafe_fsdp"), shardsafe.fabric.FSDPStrategy)
    spawn = STRATEGY_REGISTRY.get("shardsafe_ddp_spawn")
    assert isinstance(spawn, shardsafe.fabric.DDPStrategy) and spawn._start_method == "spawn"
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="shardsafe_ddp")
    assert isinstance(fabric.strategy, shardsafe.fabric.DDPStrategy)
    assert "shardsafe" in STRATEGY_REGISTRY["shardsafe_ddp"]["description"]


def test_a_checkpoint_io_plugin_is_refused() -> None:
    import lightning as L
    from lightning.fabric.plugins import TorchCheckpointIO

    import shardsafe.fabric

    with pytest.raises(shardsafe.InvalidArgumentError, match=r"TorchCheckpointIO.*shardsafe.*storage_options"):
        shardsafe.fabric.DDPStrategy(checkpoint_io=TorchCheckpointIO())
    with pytest.raises(shardsafe.InvalidArgumentError, match=r"TorchCheckpointIO.*shardsafe"):
        L.Fabric(accelerator="cpu", devices=1, strategy=shardsafe.fabric.DDPStrategy(), plugins=[TorchCheckpointIO()])
    with pytest.raises(shardsafe.InvalidArgumentError, match=r"TorchCheckpointIO.*shardsafe"):
        L.Fabric(accelerator="cpu", devices=1, strategy="shardsafe_ddp", plugins=[TorchCheckpointIO()])


def test_an_unknown_state_dict_type_is_refused() -> None:
    import shardsafe.fabric

    with pytest.raises(shardsafe.InvalidArgumentError, match=r"state_dict_type='fulll'.*'full' or 'sharded'"):
        shardsafe.fabric.FSDPStrategy(state_dict_type="fulll")  # type: ignore[arg-type]
    for ok in ("full", "sharded"):
        shardsafe.fabric.FSDPStrategy(state_dict_type=ok)  # accepted; shardsafe saves shards either way
