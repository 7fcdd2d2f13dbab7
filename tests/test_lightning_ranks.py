"""``shardsafe.lightning`` on several CPU ranks (gloo), the Trainer in each rank of the harness:

- DDP: a resume with dropout continues bit for bit (every rank's generators ride along), where Lightning's
  own strategy does not; ``trainer.save_checkpoint`` under ``if trainer.is_global_zero:`` fails within the
  deadline naming the rank that never came;
- FSDP2 (``ModelParallelStrategy``): saved on 2 ranks (each writes its shards, no gather), resumed on 1 and
  on 3 ranks: model and optimizer state resharded exactly, the generators left as they are (``"drop"``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe

from harness import check_ok, run_ranks
from models import needs_fsdp2_on_cpu

L = pytest.importorskip("lightning")


def _data() -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(24, 4, generator=g), torch.randn(24, 1, generator=g)), batch_size=4)


def _net() -> Any:
    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1))

        def configure_model(self) -> None:  # FSDP2 under ModelParallelStrategy; nothing otherwise
            from lightning.pytorch.strategies import ModelParallelStrategy

            if self._trainer is None or not isinstance(self.trainer.strategy, ModelParallelStrategy):
                return  # load_from_checkpoint in one plain process: no mesh, a plain module
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in (self.net[0], self.net[2]):
                fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=0.05)

    return Net()


def _trainer(strategy: Any, world: int, epochs: int, *callbacks: Any) -> Any:
    return L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_epochs=epochs,
        callbacks=list(callbacks),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(callbacks),
    )


def _full(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (a DTensor gathered), on CPU."""
    out = {}
    for k, v in module.state_dict().items():
        full = v.full_tensor() if hasattr(v, "full_tensor") else v
        out[k] = full.detach().cpu().clone()
    return out


def _ddp(rank: int, world: int, root: str) -> dict[str, Any]:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy as StockDDP

    import shardsafe.lightning as sl

    def ours() -> Any:
        return sl.DDPStrategy(checkpoint_timeout=60)

    out: dict[str, Any] = {"seconds": {}}
    clock = time.monotonic()
    torch.manual_seed(1)
    straight = _net()
    _trainer(ours(), world, 2).fit(straight, _data())
    out["seconds"]["straight"] = time.monotonic() - clock
    for name, strategy in (("shardsafe", ours), ("stock", StockDDP)):
        clock = time.monotonic()
        torch.manual_seed(1)
        mc = ModelCheckpoint(os.path.join(root, name), "{epoch}", save_top_k=-1)
        _trainer(strategy(), world, 1, mc).fit(_net(), _data())
        torch.manual_seed(99 + rank)  # a resume must not depend on the generators it starts with
        resumed = _net()
        t = _trainer(strategy(), world, 2)
        t.fit(resumed, _data(), ckpt_path=os.path.join(root, name, "epoch=0.ckpt"))
        out[name] = all(torch.equal(v, resumed.state_dict()[k]) for k, v in straight.state_dict().items())
        out["seconds"][name] = time.monotonic() - clock
    # a weights-only checkpoint cannot resume a fit: refused on every rank before anything changes
    t = _trainer(ours(), world, 2)
    t.fit(resumed, _data(), ckpt_path=os.path.join(root, "shardsafe", "epoch=0.ckpt"))
    t.save_checkpoint(os.path.join(root, "weights"), weights_only=True)
    torch.manual_seed(5)
    fresh = _net()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    try:
        _trainer(ours(), world, 3).fit(fresh, _data(), ckpt_path=os.path.join(root, "weights"))
    except shardsafe.MissingKeysError as err:
        out["weights_only"] = (type(err).__name__, str(err)[:300])
    out["untouched"] = all(torch.equal(v, fresh.state_dict()[k]) for k, v in before.items())
    # the mistake: a save on rank 0 alone (the shardsafe trainer; the stock one's strategy is Lightning's)
    t.strategy.checkpoint_timeout = 3
    if t.is_global_zero:
        start = time.monotonic()
        try:
            t.save_checkpoint(os.path.join(root, "guarded"))
        except shardsafe.RankTimeoutError as err:
            out["guard"] = (err.missing_ranks, time.monotonic() - start, str(err))
    return out


@pytest.mark.timeout(240)
def test_ddp_resumes_bitwise_and_a_guarded_save_fails_in_time(tmp_path: Path) -> None:
    results = check_ok(run_ranks(_ddp, 2, str(tmp_path), timeout=200, store="env"))
    for rank, r in enumerate(results):
        assert r["shardsafe"], f"rank {rank}: the resume through shardsafe did not continue bit for bit"
        assert not r["stock"], f"rank {rank}: Lightning's own strategy resumed bitwise: the test shows nothing"
    for r in results:
        assert "weights-only checkpoint" in r["weights_only"][1] and r["untouched"], r
    missing, seconds, message = results[0]["guard"]
    assert missing == [1] and seconds < 30, results[0]["guard"]
    assert "rank 1" in message or "[1]" in message, message
    assert not (tmp_path / "guarded").exists()
    shardsafe.verify(tmp_path / "shardsafe" / "epoch=0.ckpt")
    print("seconds per step on rank 0:", results[0]["seconds"])


def _fsdp(rank: int, world: int, root: str, resume: bool) -> dict[str, Any]:
    import shardsafe.lightning as sl

    strategy = sl.ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1, checkpoint_timeout=60)
    path = os.path.join(root, "fsdp.ckpt")
    model = _net()
    if not resume:
        torch.manual_seed(3)
        t = _trainer(strategy, world, 1)
        t.fit(model, _data())
        t.save_checkpoint(path)
        optimizer = t.optimizers[0]
    else:
        torch.manual_seed(50 + rank)
        t = _trainer(strategy, world, 1)  # as many epochs as saved: the fit only loads
        t.fit(model, _data(), ckpt_path=path)
        optimizer = t.optimizers[0]
    state = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone()
        for k, v in optimizer.state_dict()["state"][0].items()
    }
    return {
        "model": _full(model),
        "adam0": state,
        "step": t.global_step,
        "sharded": hasattr(model.net[0].weight, "placements"),
    }


@needs_fsdp2_on_cpu
@pytest.mark.timeout(300)
def test_fsdp2_saved_on_two_ranks_resumes_on_one_and_three(tmp_path: Path) -> None:
    saved = check_ok(run_ranks(_fsdp, 2, str(tmp_path), False, timeout=200, store="env"))
    assert saved[0]["sharded"] and saved[0]["step"] == 3
    whole = shardsafe.load(tmp_path / "fsdp.ckpt")
    for k, v in saved[0]["model"].items():
        assert torch.equal(whole["state_dict"][k], v), k
    import shardsafe.lightning as sl

    plain = sl.load_from_checkpoint(type(_net()), tmp_path / "fsdp.ckpt")  # one plain process, whole tensors
    for k, v in saved[0]["model"].items():
        assert torch.equal(plain.state_dict()[k], v), k
    for world in (1, 3):
        loaded = check_ok(run_ranks(_fsdp, world, str(tmp_path), True, timeout=200, store="env"))
        for rank, r in enumerate(loaded):
            assert r["step"] == 3, (world, rank)
            for k, v in saved[0]["model"].items():
                assert torch.equal(r["model"][k], v), (world, rank, k)
            for k, v in saved[0]["adam0"].items():
                assert torch.equal(r["adam0"][k], v), (world, rank, k)
