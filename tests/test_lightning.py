"""``shardsafe.lightning`` in one process (``SingleDeviceStrategy``): what a Trainer user meets.

- the registry names, ``Trainer(strategy="shardsafe_...")``, the refused ``CheckpointIO`` plugin and the
  accepted ``AsyncCheckpointIO``;
- ``ModelCheckpoint`` (filename template, ``save_top_k``, ``monitor``, ``save_last="link"``): folders that
  verify, the rotation deleting through ``shardsafe.delete`` (a link as a link), ``fit(ckpt_path="last")``
  continuing bit for bit with dropout (the generators ride along), ``"best"``, hooks, callback state,
  hyperparameters, ``load_from_checkpoint`` (function and mixin);
- a weights-only checkpoint given to ``fit(ckpt_path=...)`` refused before anything changes, while
  ``validate`` takes it; a ``torch.save`` file refused; keys and values the format cannot hold named;
- asynchronous saves: rotation after the commit, the last save finished at teardown, no thread left.
"""

from __future__ import annotations

import os
import threading
from argparse import Namespace
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe

L = pytest.importorskip("lightning")
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io.async_plugin import AsyncCheckpointIO  # noqa: E402
from lightning.pytorch.strategies import FSDPStrategy as FSDP  # noqa: E402
from lightning.pytorch.strategies import StrategyRegistry  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import shardsafe.lightning as sl  # noqa: E402


class Net(L.LightningModule):
    def __init__(self, width: int = 8, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Dropout(0.5), torch.nn.Linear(width, 1))
        self.seen: dict[str, Any] = {}

    def training_step(self, batch: Any, i: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        self.log("score", float(self.global_step))  # grows: the newest checkpoints are the best ("max")
        return loss

    def validation_step(self, batch: Any, i: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["mine"] = {"step": self.global_step, "tensor": torch.arange(3)}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # load_from_checkpoint: before the weights are loaded, so no "state_dict" (docs/lightning.md)
        self.seen = {"mine": checkpoint["mine"], "weights": sorted(checkpoint.get("state_dict", {}))}


class Counter(Callback):
    """A callback with state of its own."""

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, *args: Any) -> None:
        self.batches += 1

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batches = state["batches"]


def data() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(24, 4, generator=g), torch.randn(24, 1, generator=g)), batch_size=6)


def trainer(root: Path, epochs: int, *callbacks: Callback, **kw: Any) -> Any:
    kw.setdefault("strategy", sl.SingleDeviceStrategy(checkpoint_timeout=60))
    return L.Trainer(
        default_root_dir=root,
        max_epochs=epochs,
        callbacks=list(callbacks),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def committed(root: Path) -> list[str]:
    """The checkpoint folders in ``root`` (links left out)."""
    return sorted(n for n in os.listdir(root) if not (root / n).is_symlink() and (root / n / "MANIFEST.json").exists())


def test_registry_and_plugins() -> None:
    names = {n for n in StrategyRegistry if n.startswith("shardsafe_")}
    assert {"shardsafe_ddp", "shardsafe_ddp_spawn", "shardsafe_fsdp", "shardsafe_model_parallel"} <= names
    assert {
        "shardsafe_single_device",
        "shardsafe_fsdp_cpu_offload",
        "shardsafe_ddp_find_unused_parameters_true",
    } <= names
    assert StrategyRegistry["shardsafe_ddp_spawn"]["init_params"] == {"start_method": "spawn"}
    t = L.Trainer(strategy="shardsafe_ddp", accelerator="cpu", devices=1, logger=False)
    assert type(t.strategy) is sl.DDPStrategy
    t = L.Trainer(strategy=sl.SingleDeviceStrategy(), plugins=[AsyncCheckpointIO()], logger=False)
    assert t.strategy.checkpoint_async == "blocking"
    from lightning.pytorch.plugins import TorchCheckpointIO

    with pytest.raises(shardsafe.InvalidArgumentError, match=r"TorchCheckpointIO would never be called.*shardsafe"):
        L.Trainer(strategy=sl.SingleDeviceStrategy(), plugins=[TorchCheckpointIO()], logger=False)
    with pytest.raises(shardsafe.InvalidArgumentError, match="checkpoint_async='later'"):
        sl.DDPStrategy(checkpoint_async="later")  # type: ignore[arg-type]
    with pytest.raises(shardsafe.InvalidArgumentError, match=r"state_dict_type='fulll'"):
        sl.FSDPStrategy(state_dict_type="fulll")


def test_the_signature_is_lightnings_plus_the_checkpoint_options() -> None:
    """LightningCLI and jsonargparse read a strategy's arguments from its signature."""
    import inspect

    import shardsafe.fabric as sf

    params = inspect.signature(sl.FSDPStrategy).parameters
    assert params["device_mesh"].annotation == inspect.signature(FSDP).parameters["device_mesh"].annotation
    assert params["checkpoint_async"].kind is inspect.Parameter.KEYWORD_ONLY
    assert list(params)[-1] == "kwargs"
    assert {"start_method", "checkpoint_timeout", "checkpoint_overwrite"} <= set(
        inspect.signature(sf.DDPStrategy).parameters
    )
    assert list(inspect.signature(sl.ModelParallelStrategy.__init__).parameters)[:3] == [
        "self",
        "data_parallel_size",
        "tensor_parallel_size",
    ]
    strategy = sl.DDPStrategy(find_unused_parameters=True, checkpoint_async="background")
    assert strategy._ddp_kwargs == {"find_unused_parameters": True} and strategy.checkpoint_async == "background"


def test_model_checkpoint_rotation_resume_bitwise_and_load(tmp_path: Path) -> None:
    # uninterrupted: 4 epochs
    torch.manual_seed(1)
    straight = Net()
    trainer(tmp_path / "a", 4).fit(straight, data())
    # 2 epochs, then a resume from "last" for 2 more, in a fresh model and trainer
    root = tmp_path / "ckpt"
    torch.manual_seed(1)
    first = Net()
    mc = ModelCheckpoint(root, "{epoch}-{step}", monitor="score", mode="max", save_top_k=2, save_last="link")
    trainer(tmp_path / "b", 2, mc, Counter()).fit(first, data())
    assert committed(root) == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"]
    assert os.readlink(root / "last.ckpt") == "epoch=1-step=8.ckpt"  # a link, to the newest
    for name in committed(root):
        shardsafe.verify(root / name)
    info = shardsafe.inspect(root / "last.ckpt")
    assert info.metadata["step"] == 8
    kinds = {e.name: e.kind for e in info.entries if e.kind != "tensor"}
    assert kinds["state_dict"] == "module" and kinds["optimizer_states.0"] == "optimizer"
    assert kinds["shardsafe_rng"] == "stateful" and kinds["hyper_parameters"] == "value"

    torch.manual_seed(99)  # the resume must not depend on this: the generators come from the checkpoint
    resumed, counter = Net(), Counter()
    mc2 = ModelCheckpoint(root, "{epoch}-{step}", monitor="score", mode="max", save_top_k=2, save_last="link")
    t = trainer(tmp_path / "b", 4, mc2, counter)
    t.fit(resumed, data(), ckpt_path="last")
    assert resumed.seen["mine"]["step"] == 8 and torch.equal(resumed.seen["mine"]["tensor"], torch.arange(3))
    assert resumed.seen["weights"] == sorted(straight.state_dict())
    assert counter.batches == 16 and t.global_step == 16
    for k, v in weights(straight).items():  # dropout, AdamW and StepLR continued exactly
        assert torch.equal(v, resumed.state_dict()[k]), k
    # the rotation removed the two oldest (through shardsafe.delete) and replaced the link as a link
    assert committed(root) == ["epoch=2-step=12.ckpt", "epoch=3-step=16.ckpt"]
    assert os.readlink(root / "last.ckpt") == "epoch=3-step=16.ckpt"
    assert sorted(os.listdir(root)) == ["epoch=2-step=12.ckpt", "epoch=3-step=16.ckpt", "last.ckpt"]

    # "best" (the highest score: the newest), and validation from a checkpoint
    best = Net()
    t.validate(best, data(), ckpt_path="best")
    assert t.ckpt_path == str(root / "epoch=3-step=16.ckpt")
    for k, v in weights(straight).items():
        assert torch.equal(v, best.state_dict()[k]), k

    # one plain process: the function and the mixin, hyperparameters and overrides
    loaded = sl.load_from_checkpoint(Net, root / "last.ckpt", lr=0.5)
    assert type(loaded) is Net and loaded.hparams.width == 8 and loaded.hparams.lr == 0.5
    assert loaded.seen["mine"]["step"] == 16
    for k, v in weights(straight).items():
        assert torch.equal(v, loaded.state_dict()[k]), k

    class Mixed(sl.ShardsafeCheckpointMixin, Net):
        pass

    again = Mixed.load_from_checkpoint(str(root / "epoch=2-step=12.ckpt"))
    assert type(again) is Mixed and again.seen["mine"]["step"] == 12


def test_stock_lightning_does_not_resume_dropout_bitwise(tmp_path: Path) -> None:
    """The reference: the same resume through Lightning's own strategy (no generators saved)."""
    from lightning.pytorch.strategies import SingleDeviceStrategy

    torch.manual_seed(1)
    straight = Net()
    trainer(tmp_path / "a", 2, strategy=SingleDeviceStrategy("cpu")).fit(straight, data())
    torch.manual_seed(1)
    mc = ModelCheckpoint(tmp_path / "c", "{epoch}", save_top_k=-1)
    trainer(tmp_path / "b", 1, mc, strategy=SingleDeviceStrategy("cpu")).fit(Net(), data())
    torch.manual_seed(99)
    resumed = Net()
    trainer(tmp_path / "b", 2, strategy=SingleDeviceStrategy("cpu")).fit(
        resumed, data(), ckpt_path=str(tmp_path / "c" / "epoch=0.ckpt")
    )
    assert any(not torch.equal(v, resumed.state_dict()[k]) for k, v in weights(straight).items())


def test_a_weights_only_checkpoint_is_refused_by_fit_before_anything_changes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    mc = ModelCheckpoint(tmp_path / "w", "{epoch}", save_weights_only=True, save_top_k=-1)
    trainer(tmp_path, 1, mc).fit(Net(), data())
    path = tmp_path / "w" / "epoch=0.ckpt"
    kinds = {e.name for e in shardsafe.inspect(path).entries if e.kind != "tensor"}
    assert "optimizer_states.0" not in kinds and "shardsafe_rng" not in kinds and "state_dict" in kinds
    model = Net()
    before = weights(model)
    t = trainer(tmp_path / "x", 3)
    with pytest.raises(shardsafe.MissingKeysError, match=r"weights-only checkpoint.*Nothing was loaded"):
        t.fit(model, data(), ckpt_path=str(path))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert t.global_step == 0
    trainer(tmp_path / "x", 1).validate(model, data(), ckpt_path=str(path))  # weights are all validate needs
    assert any(not torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_refusals_name_the_path_or_key(tmp_path: Path) -> None:
    torch.save({"state_dict": {}}, tmp_path / "old.ckpt")
    with pytest.raises(shardsafe.CheckpointNotFoundError, match=r"old.ckpt is a file.*never unpickles"):
        trainer(tmp_path, 1).fit(Net(), data(), ckpt_path=str(tmp_path / "old.ckpt"))

    class Odd(Net):
        def __init__(self, opts: Namespace | None = None) -> None:
            super().__init__()
            self.save_hyperparameters()

    t = trainer(tmp_path, 1, enable_checkpointing=False)
    t.fit(Odd(Namespace(a=1)), data())
    with pytest.raises(shardsafe.UnsafeValueError, match=r"'hyper_parameters/opts'.*Namespace"):
        t.save_checkpoint(tmp_path / "odd")
    t = trainer(tmp_path, 1, ModelCheckpoint(tmp_path / "mc"))  # checked at setup, before any training
    with pytest.raises(shardsafe.UnsafeValueError, match=r"'hyper_parameters/opts'.*Namespace"):
        t.fit(Odd(Namespace(a=1)), data())
    assert t.global_step == 0
    t = trainer(tmp_path, 1, strategy=sl.SingleDeviceStrategy(checkpoint_allow_pickle=True))  # both sides opt in
    t.fit(Odd(Namespace(a=1)), data())
    assert shardsafe.inspect(tmp_path / "checkpoints" / "epoch=0-step=4.ckpt").metadata["step"] == 4
    with pytest.raises(shardsafe.CorruptCheckpointError, match=r"hyper_parameters/opts: .*pickled value.*allow_pickle"):
        sl.load_from_checkpoint(Odd, tmp_path / "checkpoints" / "epoch=0-step=4.ckpt")
    odd = sl.load_from_checkpoint(Odd, tmp_path / "checkpoints" / "epoch=0-step=4.ckpt", allow_pickle=True)
    assert odd.hparams.opts == Namespace(a=1)

    class Slash(Net):
        def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            checkpoint["a/b"] = 1

    t = trainer(tmp_path, 1, enable_checkpointing=False)
    t.fit(Slash(), data())
    with pytest.raises(shardsafe.InvalidTypeError, match=r"key 'a/b' cannot be stored"):
        t.save_checkpoint(tmp_path / "slash")
    assert not (tmp_path / "odd").exists() and not (tmp_path / "slash").exists()


def test_a_save_to_a_link_replaces_the_link_never_what_it_leads_to(tmp_path: Path) -> None:
    root = tmp_path / "c"
    mc = ModelCheckpoint(root, "{epoch}", save_top_k=1, save_last="link")
    t = trainer(tmp_path, 1, mc)
    t.fit(Net(), data())
    assert os.path.islink(root / "last.ckpt")
    target = root / os.readlink(root / "last.ckpt")
    before = shardsafe.inspect(target).save_id
    t.save_checkpoint(root / "last.ckpt")  # as ModelCheckpoint(save_last=True) does where a link was
    assert not os.path.islink(root / "last.ckpt") and (root / "last.ckpt" / "MANIFEST.json").exists()
    assert shardsafe.inspect(target).save_id == before  # never written through the link
    shardsafe.verify(target)


@pytest.mark.parametrize("how", ["plugin", "background"])
def test_async_saves_rotate_after_their_commit_and_finish_at_teardown(tmp_path: Path, how: str) -> None:
    root = tmp_path / "c"
    strategy = sl.SingleDeviceStrategy(checkpoint_async="background") if how == "background" else None
    kw: dict[str, Any] = {"strategy": strategy} if strategy else {"plugins": [AsyncCheckpointIO()]}
    mc = ModelCheckpoint(root, "{step}", every_n_train_steps=1, save_top_k=2, monitor="score", mode="max")
    before = {t for t in threading.enumerate() if t.name.startswith("shardsafe-")}
    t = trainer(tmp_path, 2, mc, **kw)
    t.fit(Net(), data())
    assert t.strategy.checkpoint_async == ("background" if how == "background" else "blocking")
    assert committed(root) == ["step=7.ckpt", "step=8.ckpt"]  # the last one finished at teardown
    assert sorted(os.listdir(root)) == ["step=7.ckpt", "step=8.ckpt"]
    for name in committed(root):
        shardsafe.verify(root / name)
    left = {t for t in threading.enumerate() if t.name.startswith("shardsafe-")} - before
    assert not left, left


def test_rotation_leaves_what_is_not_a_checkpoint(tmp_path: Path) -> None:
    import logging

    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    t = trainer(tmp_path, 1, enable_checkpointing=False)
    t.fit(Net(), data())
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("mine")
    logging.getLogger("shardsafe").addHandler(handler)
    try:
        t.strategy.remove_checkpoint(tmp_path / "notes")  # as ModelCheckpoint's rotation would
        t.strategy.remove_checkpoint(tmp_path / "gone.ckpt")  # nothing there: nothing to do, no warning
    finally:
        logging.getLogger("shardsafe").removeHandler(handler)
    assert (tmp_path / "notes" / "a.txt").read_text() == "mine"
    assert [m for m in messages if "not removing" in m] == [
        f"shardsafe: not removing {tmp_path / 'notes'} (ModelCheckpoint's rotation): refusing to delete "
        f"{tmp_path / 'notes'}: no checkpoint at {tmp_path / 'notes'}: the folder holds no MANIFEST.json and no file "
        "shardsafe writes ('a.txt'); check the path"
    ]


class Positioned:
    """An iterable of batches that keeps its position (Lightning saves the state of such a loader in the fit
    loop's and gives it back on resume)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(24, 4, generator=g), torch.randn(24, 1, generator=g)
        self.pos = 0
        self.loaded: dict[str, Any] | None = None

    def __iter__(self) -> Any:
        while self.pos < 4:
            i = self.pos
            self.pos += 1
            yield self.x[6 * i : 6 * i + 6], self.y[6 * i : 6 * i + 6]
        self.pos = 0

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = dict(state)
        self.pos = state["pos"]


def test_the_data_position_lightning_tracks_comes_back(tmp_path: Path) -> None:
    mc = ModelCheckpoint(tmp_path / "c", "{step}", every_n_train_steps=1, save_top_k=-1)
    trainer(tmp_path, 1, mc, max_steps=3).fit(Net(), Positioned())
    saved = shardsafe.load(tmp_path / "c" / "step=2.ckpt")["loops"]["fit_loop"]["state_dict"]
    assert saved["combined_loader"] == [{"pos": 3}]  # Lightning's fetcher had taken the next batch already
    loader = Positioned()
    t = trainer(tmp_path, 1, max_steps=4, enable_checkpointing=False)
    t.fit(Net(), loader, ckpt_path=str(tmp_path / "c" / "step=2.ckpt"))
    assert loader.loaded == {"pos": 3} and t.global_step == 3  # the one batch left in the epoch
