"""Lightning Trainer strategies whose checkpoints go through shardsafe (docs/lightning.md).

``L.Trainer(strategy=shardsafe.lightning.DDPStrategy())`` (or ``FSDPStrategy``, ``ModelParallelStrategy``,
``SingleDeviceStrategy``, with the arguments of Lightning's own) or ``L.Trainer(strategy="shardsafe_ddp")``
makes ``trainer.save_checkpoint``, ``ModelCheckpoint`` and ``fit/validate/test(ckpt_path=...)`` shardsafe saves,
deletes and loads: every rank writes its share (FSDP shards by their owners, no gather), the commit is all or
nothing, every byte is checksummed, nothing is unpickled, the random generators of every rank are kept, a
checkpoint loads on any world size, and a save under ``if trainer.is_global_zero:`` raises
:class:`~shardsafe.RankTimeoutError` naming the missing ranks instead of hanging.

Importing this module registers the strategies in the Trainer's ``StrategyRegistry`` under Lightning's names
prefixed ``shardsafe_`` (``shardsafe_ddp``, ``shardsafe_ddp_spawn``..., ``shardsafe_fsdp``,
``shardsafe_fsdp_cpu_offload``, ``shardsafe_single_device``) and ``shardsafe_model_parallel``.
:func:`load_from_checkpoint` builds a LightningModule from a checkpoint in one plain process;
:func:`latest_checkpoint` finds the newest intact checkpoint of a folder (to resume after a crash).

This module imports ``lightning``; ``import shardsafe`` does not (install ``shardsafe[lightning]``).
"""

from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

from shardsafe.lightning.loading import ShardsafeCheckpointMixin, latest_checkpoint, load_from_checkpoint
from shardsafe.lightning.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

__all__ = [
    "DDPStrategy",
    "FSDPStrategy",
    "ModelParallelStrategy",
    "ShardsafeCheckpointMixin",
    "SingleDeviceStrategy",
    "latest_checkpoint",
    "load_from_checkpoint",
]

for _strategy in (DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy):  # see the docstring
    _strategy.register_strategies(StrategyRegistry)
