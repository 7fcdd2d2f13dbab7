"""Lightning Fabric strategies whose checkpoints go through shardsafe (docs/fabric.md).

``L.Fabric(strategy=shardsafe.fabric.DDPStrategy(...))`` (or ``FSDPStrategy``, ``ModelParallelStrategy``)
makes ``fabric.save(path, state)``, ``fabric.load(path, state)`` and ``fabric.load_raw(path, obj)``
shardsafe saves and loads, with no other change to the script: every rank writes its share, the commit is
all-or-nothing, every byte is checksummed, nothing is unpickled, a checkpoint loads on any world size and
strategy, and a ``fabric.save`` under ``if fabric.global_rank == 0:`` raises :class:`RankTimeoutError`
naming the missing ranks instead of hanging.

Each class takes exactly the arguments of the Fabric strategy it extends, plus two keyword-only ones:
``checkpoint_timeout`` (seconds every checkpoint wait may take; default ``SHARDSAFE_TIMEOUT``) and
``checkpoint_overwrite`` (default True, as ``fabric.save`` overwrites: an existing checkpoint at the path
is replaced atomically; anything that is not a shardsafe checkpoint is refused untouched).

Importing this module registers the strategies in Fabric's strategy registry under Fabric's names with a
``shardsafe_`` prefix (``L.Fabric(strategy="shardsafe_ddp")``, ``"shardsafe_fsdp"``...): Lightning loads no
strategy plugins (it has no entry point for them), so the import is the registration.
``python -m shardsafe.fabric run --strategy shardsafe_ddp script.py`` is ``fabric run`` with those names known
(``fabric run`` checks ``--strategy`` against the registry of its own process); the script imports this module
too, before it creates its ``Fabric``.

A ``CheckpointIO`` plugin (``checkpoint_io=`` or ``plugins=``) is refused: it would never be called.

This module imports ``lightning``; ``import shardsafe`` does not import it (install ``shardsafe[fabric]``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.fabric.strategies.ddp import DDPStrategy as _FabricDDPStrategy
from lightning.fabric.strategies.fsdp import FSDPStrategy as _FabricFSDPStrategy
from lightning.fabric.strategies.model_parallel import ModelParallelStrategy as _FabricModelParallelStrategy
from torch import nn
from torch.optim import Optimizer

from shardsafe.engine import api
from shardsafe.errors import InvalidCallError, InvalidTypeError, StateMismatchError
from shardsafe.integration import StrategyCheckpoints, check_state_dict_type, expose_signature, refuse_pickle_file
from shardsafe.state.flatten import Filtered

__all__ = ["DDPStrategy", "FSDPStrategy", "ModelParallelStrategy"]


class _ShardsafeCheckpoints(StrategyCheckpoints):
    """Replaces a Fabric strategy's checkpoint methods; mixed in before the strategy class. The options
    (``checkpoint_timeout``, ``checkpoint_overwrite``, the refused ``CheckpointIO``, the registry names) are
    :class:`~shardsafe.integration.StrategyCheckpoints`', shared with the Trainer's strategies."""

    _framework = "Fabric"

    def save_checkpoint(
        self,
        path: str | os.PathLike[str],
        state: dict[str, nn.Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """(every rank) ``fabric.save``: one shardsafe checkpoint (a directory) at ``path``.

        ``filter`` keeps, per state key, the items of that entry's state dict it accepts (as Fabric
        does); a filtered module stays loadable into a module with ``strict=False``. ``storage_options``
        go to the storage backend (fsspec options for ``s3://...`` paths)."""
        if storage_options is not None and not isinstance(storage_options, dict):
            raise InvalidTypeError(
                f"storage_options must be a dict of storage backend options, not {storage_options!r}"
            )
        entries: dict[str, Any] = dict(state)
        for key, keep in (filter or {}).items():
            if key in entries:
                entries[key] = Filtered(entries[key], keep)
        api.save(
            path,
            entries,
            overwrite=self._checkpoint_overwrite,
            timeout=self._checkpoint_timeout,
            storage_options=storage_options,
        )

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """(every rank) ``fabric.load`` / ``fabric.load_raw``. With a dict: restores its objects in place and
        returns the small entries it did not ask for (``rest="values"``; the others are not read). With
        nothing: the whole checkpoint, CPU tensors. With a module (``load_raw``): the checkpoint's only
        module entry, or a checkpoint saved from a bare state dict. ``weights_only`` is accepted and
        moot: shardsafe never unpickles."""
        refuse_pickle_file(path)
        if not state:
            return api.load(path)
        if isinstance(state, nn.Module):
            self._load_raw_module(path, state, strict)
            return {}
        if isinstance(state, Optimizer):
            raise NotImplementedError(
                "fabric.load_raw(path, optimizer) is not supported with shardsafe strategies: optimizer state is "
                "keyed by parameter name, which only the model knows. Load it with its model: "
                'fabric.load(path, {"model": model, "optimizer": optimizer}).'
            )
        return api.load(path, state, strict=strict, timeout=self._checkpoint_timeout)

    def _load_raw_module(self, path: str | os.PathLike[str], module: nn.Module, strict: bool) -> None:
        info = api.inspect(path)
        objects = [e for e in info.entries if e.kind != "tensor"]
        modules = [e.name for e in objects if e.kind == "module"]
        if len(modules) == 1:
            api.load(path, {modules[0]: module}, strict=strict, timeout=self._checkpoint_timeout)
            return
        if modules or any(e.kind != "value" for e in objects):
            raise InvalidCallError(
                f"fabric.load_raw({os.fspath(path)!r}, module): the checkpoint holds {len(modules)} modules "
                f"({modules}); load_raw needs exactly one. Use fabric.load(path, {{name: module}}) instead."
            )
        from shardsafe.state.flatten import module_state

        saved = {e.name for e in objects}
        targets = dict(module_state(module))  # filled in place: the module's storage (FSDP1: its flat shards)
        unexpected = sorted(saved - set(targets))
        if strict and unexpected:
            raise StateMismatchError(
                f"fabric.load_raw({os.fspath(path)!r}, module): the checkpoint holds {unexpected}, which the module "
                "does not have; nothing was loaded. Pass strict=False to load the rest."
            )
        wanted = targets if strict else {k: v for k, v in targets.items() if k in saved}
        api.load(path, wanted, strict=strict, timeout=self._checkpoint_timeout)


@expose_signature
class DDPStrategy(_ShardsafeCheckpoints, _FabricDDPStrategy):
    """Fabric's :class:`~lightning.fabric.strategies.DDPStrategy`, checkpoints through shardsafe."""


@expose_signature
class FSDPStrategy(_ShardsafeCheckpoints, _FabricFSDPStrategy):
    """Fabric's :class:`~lightning.fabric.strategies.FSDPStrategy` (FSDP1), checkpoints through shardsafe:
    each rank writes its own flat shard, no state is gathered, whatever ``state_dict_type`` says (which
    must still be one of Fabric's values, ``"full"`` or ``"sharded"``)."""

    def _check_options(self) -> None:
        super()._check_options()
        check_state_dict_type(getattr(self, "_state_dict_type", None))


@expose_signature
class ModelParallelStrategy(_ShardsafeCheckpoints, _FabricModelParallelStrategy):
    """Fabric's :class:`~lightning.fabric.strategies.ModelParallelStrategy` (FSDP2 and tensor parallelism on
    a 2-D mesh), checkpoints through shardsafe, whatever ``save_distributed_checkpoint`` says."""


for _strategy in (DDPStrategy, FSDPStrategy, ModelParallelStrategy):  # see the module docstring
    _strategy.register_strategies(STRATEGY_REGISTRY)

if __name__ == "__main__":  # python -m shardsafe.fabric run ...: Fabric's CLI, the shardsafe_* names registered
    # above (lightning.fabric.cli reads the registry once, when imported); the real module's classes replace
    # this __main__ copy's under the same names, for a script run in this process
    from lightning.fabric.cli import _main

    import shardsafe.fabric  # noqa: F401

    _main(prog_name="python -m shardsafe.fabric")
