"""The Trainer's strategies with checkpoints through shardsafe: Lightning's ``DDPStrategy``,
``FSDPStrategy``, ``ModelParallelStrategy`` and ``SingleDeviceStrategy``, each extended by
:class:`_TrainerCheckpoints` (docs/lightning.md).

Who calls what (Lightning's Trainer):

- ``trainer.save_checkpoint`` / ``ModelCheckpoint`` (every rank): ``dump_checkpoint`` asks the strategy for
  ``lightning_module_state_dict()`` and ``optimizer_state(opt)`` (markers, no gather), then
  ``save_checkpoint(checkpoint, path)``: one shardsafe save on every rank (:mod:`.checkpoint` maps the dict);
- ``ModelCheckpoint``'s rotation (every rank): ``remove_checkpoint(path)``; rank 0 deletes with
  :func:`shardsafe.delete` (a link as a link), after the save in flight, if any, has committed;
- ``fit/validate/test(ckpt_path=...)`` (every rank, after the strategy's setup:
  ``restore_checkpoint_after_setup``): ``load_checkpoint(path)``, one shardsafe load that fills the model, the
  optimizers (when fitting) and the random generators in place and returns the values; then
  ``load_model_state_dict`` and ``load_optimizer_state_dict`` have nothing left to do;
- ``teardown`` (every rank): the last asynchronous save is waited for, its error raised.
"""

from __future__ import annotations

import logging
import os
from types import MappingProxyType
from typing import Any, Literal

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.io.async_plugin import AsyncCheckpointIO
from lightning.pytorch.strategies.ddp import DDPStrategy as _DDPStrategy
from lightning.pytorch.strategies.fsdp import FSDPStrategy as _FSDPStrategy
from lightning.pytorch.strategies.model_parallel import ModelParallelStrategy as _ModelParallelStrategy
from lightning.pytorch.strategies.single_device import SingleDeviceStrategy as _SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from shardsafe.deadline import Deadlines
from shardsafe.engine import api
from shardsafe.engine.remove import delete
from shardsafe.engine.save import SaveHandle
from shardsafe.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidArgumentError,
    InvalidCallError,
    MissingKeysError,
)
from shardsafe.integration import StrategyCheckpoints, check_state_dict_type, expose_signature, refuse_pickle_file
from shardsafe.lightning.checkpoint import (
    MODULE_KEY,
    ModuleState,
    OptimizerState,
    check_hparams,
    load_plan,
    loaded_checkpoint,
    to_state,
)
from shardsafe.state.rng import Policy

logger = logging.getLogger(__name__)

__all__ = ["DDPStrategy", "FSDPStrategy", "ModelParallelStrategy", "SingleDeviceStrategy"]

Async = Literal["blocking", "background"] | bool


class _TrainerCheckpoints(StrategyCheckpoints):
    """Replaces a Trainer strategy's checkpoint methods; mixed in before the strategy class. Takes the
    strategy's own arguments plus the keyword-only ``checkpoint_timeout``, ``checkpoint_overwrite``
    (:class:`~shardsafe.integration.StrategyCheckpoints`), ``checkpoint_async`` and ``checkpoint_rng``."""

    _framework = "Lightning"
    _checkpoint_async: Literal["blocking", "background"] | None
    _checkpoint_rng: Policy
    _checkpoint_io: Any  # Lightning's Strategy's

    def __init__(
        self,
        *args: Any,
        checkpoint_timeout: float | Deadlines | None = None,
        checkpoint_overwrite: bool = True,
        checkpoint_async: Async = False,
        checkpoint_rng: Policy = "drop",
        checkpoint_allow_pickle: bool = False,
        **kwargs: Any,
    ) -> None:
        """``checkpoint_async``: ``False`` (default) saves before returning; ``True`` or ``"blocking"``:
        ``shardsafe.async_save`` (returns once this rank's share is copied; Lightning's ``AsyncCheckpointIO``
        plugin asks for this); ``"background"``: returns before copying (``staging="background"``).
        ``checkpoint_rng``: :class:`~shardsafe.RNGState`'s ``per_rank`` policy for a resume on another
        world size (``"drop"`` or ``"error"``). ``checkpoint_allow_pickle``: values only pickle can hold (an
        ``argparse.Namespace`` in the hyperparameters) are saved pickled, and loads accept them (both sides
        opt in, as ``shardsafe.save``/``load(allow_pickle=True)``); default False refuses them by name."""
        if checkpoint_async not in (False, True, "blocking", "background"):
            raise InvalidArgumentError(
                f"checkpoint_async={checkpoint_async!r}: give False, True ('blocking') or 'background'"
            )
        if checkpoint_rng not in ("drop", "error"):
            raise InvalidArgumentError(f"checkpoint_rng={checkpoint_rng!r}: give 'drop' or 'error'")
        self._checkpoint_async = (
            None if checkpoint_async is False else "blocking" if checkpoint_async is True else (checkpoint_async)
        )
        self._checkpoint_rng = checkpoint_rng
        if not isinstance(checkpoint_allow_pickle, bool):
            raise InvalidArgumentError(f"checkpoint_allow_pickle must be a bool, not {checkpoint_allow_pickle!r}")
        self._checkpoint_allow_pickle = checkpoint_allow_pickle
        self._in_flight: SaveHandle | None = None
        self._removals: list[str] = []  # rank 0: paths to delete once the save in flight has committed
        self._storage_options: dict[str, Any] | None = None
        super().__init__(
            *args, checkpoint_timeout=checkpoint_timeout, checkpoint_overwrite=checkpoint_overwrite, **kwargs
        )

    # ------------------------------------------------------------------------------- options

    def _accept_checkpoint_io(self, io: Any) -> None:
        """Lightning's ``AsyncCheckpointIO`` around its default plugin asks for asynchronous saves; any other
        plugin would never be called and is refused."""
        inner = getattr(io, "checkpoint_io", None)
        if isinstance(io, AsyncCheckpointIO) and (inner is None or type(inner) is TorchCheckpointIO):
            if self._checkpoint_async is None:
                self._checkpoint_async = "blocking"
            self._checkpoint_io = None  # never called: Lightning's default stands in for it
            return
        super()._accept_checkpoint_io(io)

    @property
    def checkpoint_async(self) -> Literal["blocking", "background"] | None:
        """How saves run: ``None`` (before returning), ``"blocking"`` or ``"background"`` (asynchronously)."""
        return self._checkpoint_async

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """True: a checkpoint is loaded once the model is wrapped and the optimizers exist, in one load."""
        return True

    def setup(self, trainer: Any) -> None:
        """Lightning's setup; then, when the run will save checkpoints (fitting, with a ``ModelCheckpoint``),
        the hyperparameters are checked against what a checkpoint can hold, so that one the format refuses
        stops the run now, not at its first checkpoint."""
        super().setup(trainer)  # type: ignore[misc]
        if trainer.state.fn == TrainerFn.FITTING and trainer.checkpoint_callbacks:
            check_hparams(trainer, allow_pickle=self._checkpoint_allow_pickle)

    # ------------------------------------------------------------------------------- save

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """(every rank) A marker holding the module's own state dict, no gather: the save writes the module."""
        return ModuleState(self._checkpoint_module())

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """(every rank) A marker holding the optimizer's own state dict, no gather: the save writes it."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return OptimizerState(optimizer)

    def _checkpoint_module(self) -> nn.Module:
        module = self.model  # type: ignore[attr-defined]  # wrapped (DDP, FSDP1), or the LightningModule
        if not isinstance(module, nn.Module):
            raise InvalidCallError("shardsafe.lightning: no model is attached to the strategy; call fit or validate")
        return module

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | os.PathLike[str], storage_options: Any | None = None
    ) -> None:
        """(every rank) One shardsafe checkpoint (a folder) at ``filepath``: every rank writes its share, the
        commit is all or nothing. A symbolic link there (``ModelCheckpoint(save_last="link")``) is removed as
        a link first, by rank 0."""
        path = os.fspath(filepath)
        self._finish_pending()
        if self.is_global_zero:  # type: ignore[attr-defined]
            self._replace_link(path, storage_options)
        weights_only = "optimizer_states" not in checkpoint
        state = to_state(checkpoint, self._checkpoint_module(), rng=not weights_only)
        metadata = {
            "step": checkpoint.get("global_step"),
            "epoch": checkpoint.get("epoch"),
            "weights_only": weights_only,
        }
        self._storage_options = storage_options
        options: dict[str, Any] = {
            "allow_pickle": self._checkpoint_allow_pickle,
            "overwrite": self._checkpoint_overwrite,
            "timeout": self._checkpoint_timeout,
            "storage_options": storage_options,
            "metadata": metadata,
        }
        if self._checkpoint_async is None:
            api.save(path, state, **options)
        else:
            self._in_flight = api.async_save(path, state, staging=self._checkpoint_async, **options)

    def _replace_link(self, path: str, storage_options: Any) -> None:
        """(rank 0) A link at ``path`` goes as a link (never followed); one :func:`delete` refuses is left
        for the save to refuse on every rank."""
        local = path.removeprefix("file://")
        if "://" in local or not os.path.islink(local.rstrip("/")):
            return
        try:
            delete(path, timeout=self._checkpoint_timeout, storage_options=storage_options)
        except InvalidArgumentError as err:
            logger.warning("shardsafe: %s", err)

    def remove_checkpoint(self, filepath: str | os.PathLike[str]) -> None:
        """(every rank; rank 0 acts) ``ModelCheckpoint``'s rotation: :func:`shardsafe.delete` of ``filepath``,
        once the save in flight (if any) has committed, so that a failed save never costs the checkpoint it
        was to replace. A path that holds nothing is fine; one that is not a shardsafe checkpoint is left
        with a WARNING (shardsafe deletes only what it wrote)."""
        if not self.is_global_zero:  # type: ignore[attr-defined]
            return
        path = os.fspath(filepath)
        if self._in_flight is not None:
            self._removals.append(path)
            return
        self._remove(path)

    def _remove(self, path: str) -> None:
        try:
            delete(path, timeout=self._checkpoint_timeout, storage_options=self._storage_options)
        except CheckpointNotFoundError as err:
            if os.path.lexists(path.removeprefix("file://")) or "://" in path.removeprefix("file://"):
                logger.warning("shardsafe: not removing %s (ModelCheckpoint's rotation): %s", path, err)
        except (CorruptCheckpointError, InvalidArgumentError) as err:
            logger.warning("shardsafe: not removing %s (ModelCheckpoint's rotation): %s", path, err)

    def _finish_pending(self) -> None:
        """(every rank) Wait for the save in flight and raise its error; then (rank 0) the removals that
        waited for it. After a failed save they are dropped: what it was to replace stays."""
        handle, self._in_flight = self._in_flight, None
        removals, self._removals = self._removals, []
        if handle is None:
            return
        try:
            handle.wait()
        except BaseException:
            if removals:
                logger.warning("shardsafe: the save of %s failed: keeping %s", handle.path, removals)
            raise
        for path in removals:
            self._remove(path)

    def teardown(self) -> None:
        """(every rank) The last asynchronous save is finished (its error raised), then Lightning's teardown."""
        try:
            self._finish_pending()
        finally:
            super().teardown()  # type: ignore[misc]

    # ------------------------------------------------------------------------------- load

    def load_checkpoint(
        self, checkpoint_path: str | os.PathLike[str], weights_only: bool | None = None
    ) -> dict[str, Any]:
        """(every rank) One shardsafe load: the model, the optimizers (when fitting) and the generators in place,
        resharded from any saved world size; returns Lightning's dict of the rest. ``weights_only`` is moot:
        shardsafe never unpickles. Refused before anything changes: a file (``torch.save``), a folder that is no
        checkpoint, a weights-only checkpoint when fitting, any missing key or mismatched shape."""
        self._finish_pending()
        path = os.fspath(checkpoint_path)
        refuse_pickle_file(path)
        info = api.inspect(path, storage_options=self._storage_options)
        kinds = {e.name: e.kind for e in info.entries if e.kind != "tensor"}
        lm = self.lightning_module  # type: ignore[attr-defined]
        fitting = lm is not None and lm._trainer is not None and lm.trainer.state.fn == TrainerFn.FITTING
        opts = self.optimizers  # type: ignore[attr-defined]
        optimizers = [o._optimizer if isinstance(o, LightningOptimizer) else o for o in opts] if fitting else None
        module = self._checkpoint_module()
        plan = load_plan(path, kinds, module, optimizers, rng=self._checkpoint_rng if fitting else None)
        strict = lm.strict_loading if lm is not None else True
        try:
            api.load(
                path,
                plan.state,
                strict=strict,
                timeout=self._checkpoint_timeout,
                storage_options=self._storage_options,
                allow_pickle=self._checkpoint_allow_pickle,
                rest="none",
            )
        except MissingKeysError as err:
            if "kept per rank by the" not in str(err):
                raise
            raise MissingKeysError(
                f"{err} Values that differed between the ranks at the save (e.g. ModelCheckpoint's scores of a metric "
                "each rank logged itself) have no owner on another world size: log such metrics with "
                "sync_dist=True, resume on the saved number of ranks, or set model.strict_loading = False to start "
                "them afresh.",
                getattr(err, "missing", []),
                getattr(err, "available", []),
            ) from err
        return loaded_checkpoint(plan, module)

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Loaded by :meth:`load_checkpoint` already; a dict a hook put in place of the view is loaded as Lightning
        would (``load_state_dict``)."""
        weights = checkpoint.get(MODULE_KEY)
        if isinstance(weights, MappingProxyType):
            return
        self.lightning_module.load_state_dict(weights, strict=strict)  # type: ignore[attr-defined]

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Loaded by :meth:`load_checkpoint` already; a dict a hook put in place of a view is loaded as Lightning
        would."""
        for opt, saved in zip(self.optimizers, checkpoint.get("optimizer_states", []), strict=False):  # type: ignore[attr-defined]
            if not isinstance(saved, MappingProxyType):
                opt.load_state_dict(saved)


@expose_signature
class DDPStrategy(_TrainerCheckpoints, _DDPStrategy):
    """Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy`, checkpoints through shardsafe."""


@expose_signature
class FSDPStrategy(_TrainerCheckpoints, _FSDPStrategy):
    """Lightning's :class:`~lightning.pytorch.strategies.FSDPStrategy` (FSDP1), checkpoints through shardsafe:
    each rank writes its own flat shard, nothing is gathered, whatever ``state_dict_type`` says (``"full"`` or
    ``"sharded"``)."""

    def _check_options(self) -> None:
        super()._check_options()
        check_state_dict_type(getattr(self, "_state_dict_type", None))


@expose_signature
class ModelParallelStrategy(_TrainerCheckpoints, _ModelParallelStrategy):
    """Lightning's :class:`~lightning.pytorch.strategies.ModelParallelStrategy` (FSDP2 and tensor parallelism),
    checkpoints through shardsafe whatever ``save_distributed_checkpoint`` says."""

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """``shardsafe_model_parallel`` (Lightning registers no name for it: its arguments default to
        ``"auto"``)."""
        strategy_registry.register(
            "shardsafe_model_parallel",
            cls,
            description="FSDP2 and tensor parallelism on a 2-D mesh; checkpoints through shardsafe",
            override=True,
        )


@expose_signature
class SingleDeviceStrategy(_TrainerCheckpoints, _SingleDeviceStrategy):
    """Lightning's :class:`~lightning.pytorch.strategies.SingleDeviceStrategy` (one process, one device),
    checkpoints through shardsafe."""
