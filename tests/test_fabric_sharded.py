"""``shardsafe.fabric.FSDPStrategy`` (FSDP1) and ``shardsafe.fabric.ModelParallelStrategy`` (FSDP2 x tensor
parallel) inside real Lightning Fabric scripts that use only ``fabric.save``/``fabric.load``.

Fabric runs these strategies on GPUs: the GPU test (world size 1) runs where CUDA is visible and is
skipped elsewhere. They also run on 2 CPU processes: ModelParallelStrategy as is (tensor parallel over
both ranks); Fabric's FSDPStrategy passes ``device_id=None``, which FSDP1 refuses without an
accelerator, so the CPU run gives FSDP1 ``device_id=cpu`` (a test shim, nothing else changes). Each
Fabric launch costs ~12 s; ``SHARDSAFE_SKIP_FABRIC_CPU=1`` skips the CPU runs.
"""

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

pytest.importorskip("lightning")

from models import needs_fsdp2_on_cpu

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from torch import nn
    import lightning as L
    import shardsafe
    import shardsafe.fabric


    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(6, 10)
            self.down = nn.Linear(10, 5)
            self.head = nn.Linear(5, 3)

        def forward(self, x):
            return self.head(self.down(torch.relu(self.up(x))))


    def parallelize(model, mesh):
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if mesh["tensor_parallel"].size() > 1:
            parallelize_module(model, mesh["tensor_parallel"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(model, mesh=mesh["data_parallel"])
        return model


    def full(model, opt):
        \"\"\"Whole tensors by name (collectives: test only).\"\"\"
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model, opt = model._forward_module, opt.optimizer  # Fabric's wrappers hide the FSDP module from torch
        msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
        out = {f"model/{k}": v for k, v in msd.items()}
        out.update({f"opt/{n}/{k}": v for n, st in osd["state"].items() for k, v in st.items()})
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone() for k, v in out.items()}


    def fresh(fabric, seed):
        torch.manual_seed(seed)
        model = fabric.setup_module(MLP())
        return model, fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.01))


    def main(kind, accelerator, devices, root):
        if kind == "fsdp":
            if accelerator == "cpu":  # FSDP1 needs device_id=cpu on a machine without an accelerator
                import torch.distributed.fsdp as fsdp

                base = fsdp.FullyShardedDataParallel

                class CPUFSDP(base):
                    def __init__(self, module, *args, device_id=None, **kwargs):
                        super().__init__(module, *args, device_id=device_id or torch.device("cpu"), **kwargs)

                fsdp.FullyShardedDataParallel = CPUFSDP
            strategy = shardsafe.fabric.FSDPStrategy(checkpoint_timeout=120)
        else:
            strategy = shardsafe.fabric.ModelParallelStrategy(parallelize_fn=parallelize, checkpoint_timeout=120)
        fabric = L.Fabric(accelerator=accelerator, devices=devices, strategy=strategy)
        fabric.launch()
        rank, out = fabric.global_rank, {}
        model, opt = fresh(fabric, 0)
        for step in range(2):
            x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step)).to(fabric.device)
            fabric.backward(model(x).pow(2).mean())
            opt.step()
            opt.zero_grad()
        fabric.save(f"{root}/ckpt", {"model": model, "optim": opt, "step": 2})
        saved = full(model, opt)
        m2, o2 = fresh(fabric, 1)
        asked = {"model": m2, "optim": o2, "step": 0}
        fabric.load(f"{root}/ckpt", asked)
        loaded = full(m2, o2)
        out["bitwise"] = sorted(saved) == sorted(loaded) and all(torch.equal(saved[k], loaded[k]) for k in saved)
        out["step"] = asked["step"]
        plain, plain_opt = MLP(), None
        plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.01)
        shardsafe.load(f"{root}/ckpt", {"model": plain, "optim": plain_opt})  # one plain process, CPU
        sd = plain.state_dict()
        out["portable"] = all(torch.equal(sd[k[len("model/"):]], v) for k, v in saved.items() if k.startswith("model/"))

        fabric.save(f"{root}/weights", {"model": model})
        m3, o3 = fresh(fabric, 2)
        try:
            fabric.load(f"{root}/weights", {"model": m3, "optim": o3})
        except shardsafe.MissingKeysError as err:
            out["missing"] = [err.missing, err.available]
        fabric.load(f"{root}/weights", {"model": m3, "optim": o3}, strict=False)
        out["no_optimizer_state"] = len(o3.optimizer.state) == 0  # (full() below would step it: DCP does)
        after = full(m3, o3)
        out["weights_only"] = all(torch.equal(saved[k], after[k]) for k in saved if k.startswith("model/"))
        fabric.save(f"{root}/bare", dict(plain.state_dict()))  # a bare state dict, then load_raw in place
        m4, o4 = fresh(fabric, 3)
        fabric.load_raw(f"{root}/bare", m4)
        after = full(m4, o4)
        out["raw"] = all(torch.equal(saved[k], after[k]) for k in saved if k.startswith("model/"))
        if fabric.world_size > 1:
            fabric.strategy.checkpoint_timeout = 4.0
            if rank == 0:
                try:
                    fabric.save(f"{root}/guarded", {"model": model})
                except shardsafe.RankTimeoutError as err:
                    out["guard"] = [err.missing_ranks, str(err)]
        with open(f"{root}/rank{rank}.json", "w") as f:
            json.dump(out, f)
        # an orderly teardown: a rank that exits while another is still in the guarded save above can
        # abort in gloo's teardown ("terminate called without an active exception")
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


    if __name__ == "__main__":
        main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
    """
)


def _run(tmp_path: Path, kind: str, accelerator: str, devices: int) -> list[dict[str, Any]]:
    script = tmp_path / "fabric_sharded.py"
    script.write_text(SCRIPT)
    root = tmp_path / "ckpts"
    root.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        [sys.executable, str(script), kind, accelerator, str(devices), str(root)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [json.loads((root / f"rank{r}.json").read_text()) for r in range(devices)]
    for out in results:
        assert out["bitwise"] and out["step"] == 2 and out["portable"], out
        assert out["missing"] == [["optim"], ["model"]], out
        assert out["weights_only"] and out["no_optimizer_state"] and out["raw"], out
    if devices > 1:
        assert results[0]["guard"][0] == [1] and "guard" not in results[1]
        assert "waited 4s for every rank to arrive" in results[0]["guard"][1]
    return results


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Fabric's FSDP and ModelParallel strategies need a GPU")
@pytest.mark.parametrize("kind", ["fsdp", "model_parallel"])
def test_fabric_sharded_strategy_on_one_gpu(tmp_path: Path, kind: str) -> None:
    _run(tmp_path, kind, "cuda", 1)


@pytest.mark.skipif(os.environ.get("SHARDSAFE_SKIP_FABRIC_CPU") == "1", reason="SHARDSAFE_SKIP_FABRIC_CPU=1")
@pytest.mark.parametrize("kind", ["fsdp", pytest.param("model_parallel", marks=needs_fsdp2_on_cpu)])
def test_fabric_sharded_strategy_on_two_cpu_processes(tmp_path: Path, kind: str) -> None:
    _run(tmp_path, kind, "cpu", 2)
