"""Lightning's checkpoint dict <-> a shardsafe state (docs/lightning.md, "What a checkpoint holds").

The Trainer builds its checkpoint dict (``_CheckpointConnector.dump_checkpoint``) from the strategy's
``lightning_module_state_dict()`` and ``optimizer_state(optimizer)``. The shardsafe strategies return
markers there (:class:`ModuleState`, :class:`OptimizerState`: the live state dicts, built without a
gather), so that at the save the module and the optimizers themselves become entries of the state
(:func:`to_state`): FSDP shards are written by their owners, optimizer state is keyed by parameter name,
and a load reshards. Every other key is a typed value (loops, callbacks, lr_schedulers, hparams, the
precision plugin's and the datamodule's state, what ``on_save_checkpoint`` hooks add), and the process's
random generators ride along per rank as :class:`~shardsafe.RNGState` under :data:`RNG_KEY`.

A load (:func:`load_plan`) asks for every value entry by name, so a value some rank kept per rank is
refused by name on another world size, and fills the module and optimizers in place; the dict handed back
to Lightning (:func:`loaded_checkpoint`) holds the values, and read-only views of the loaded state dicts
under ``state_dict`` and ``optimizer_states``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from shardsafe.errors import InvalidTypeError, MissingKeysError
from shardsafe.format.values import encode
from shardsafe.state.flatten import Filtered, module_state
from shardsafe.state.rng import Policy, RNGState

__all__ = [
    "MODULE_KEY",
    "OPTIMIZER_PREFIX",
    "RNG_KEY",
    "LoadPlan",
    "ModuleState",
    "OptimizerState",
    "check_hparams",
    "load_plan",
    "loaded_checkpoint",
    "to_state",
]

MODULE_KEY = "state_dict"
"""Lightning's key for the model's weights; the module entry keeps it."""
OPTIMIZER_PREFIX = "optimizer_states."
"""``optimizer_states.<i>``: the ``i``-th optimizer, an entry of its own (a module or optimizer nested in
a value is refused: each is an entry, saved under its parameter names)."""
RNG_KEY = "shardsafe_rng"
"""The process's random generators (:class:`~shardsafe.RNGState`), per rank."""


class ModuleState(dict[str, Any]):
    """What the shardsafe strategies' ``lightning_module_state_dict()`` returns: the module's own state dict
    (tensors that share storage with its parameters; FSDP1: this rank's boxes), and the module. Left as it
    is by the hooks, the module itself is saved; with keys deleted, the rest of it; replaced, the dict."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module_state(module))
        self.module = module
        self.original = dict(self)

    def untouched(self) -> bool:
        return self.keys() == self.original.keys() and all(self[k] is v for k, v in self.original.items())

    def only_removed(self) -> bool:
        return self.keys() <= self.original.keys() and all(self[k] is self.original[k] for k in self)


class OptimizerState(dict[str, Any]):
    """What ``optimizer_state(optimizer)`` returns: the optimizer's ``state_dict()`` (its own tensors,
    local: no gather under FSDP) and the optimizer, which is saved as an entry of its own."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer.state_dict())
        self.optimizer = optimizer


def to_state(checkpoint: Mapping[str, Any], module: nn.Module, *, rng: bool) -> dict[str, Any]:
    """(every rank) The shardsafe state of a Lightning checkpoint dict: the module and optimizers as
    entries, the rest as values (see the module docstring); with ``rng``, this process's generators.
    Raises :class:`InvalidTypeError` naming a top-level key the format cannot hold."""
    state: dict[str, Any] = {}
    for key, value in checkpoint.items():
        if not isinstance(key, str) or not key or "/" in key:
            raise InvalidTypeError(
                f"the checkpoint's key {key!r} cannot be stored: shardsafe.lightning saves each top-level key of "
                "Lightning's checkpoint dict as an entry, whose name is a non-empty str without '/'. Rename it in "
                "the on_save_checkpoint hook that adds it (or nest it under a dict key)."
            )
        if key in (RNG_KEY,) or key.startswith(OPTIMIZER_PREFIX):
            raise InvalidTypeError(
                f"the checkpoint's key {key!r} is the name shardsafe.lightning gives its own entries; rename it in "
                "the on_save_checkpoint hook that adds it"
            )
        if key == MODULE_KEY:
            state[key] = _module_entry(value, module)
        elif key == "optimizer_states" and isinstance(value, list):
            for i, opt in enumerate(value):
                state[f"{OPTIMIZER_PREFIX}{i}"] = opt.optimizer if isinstance(opt, OptimizerState) else opt
        else:
            state[key] = value
    if rng:
        state[RNG_KEY] = RNGState()
    return state


def _module_entry(value: Any, module: nn.Module) -> Any:
    if not isinstance(value, ModuleState):
        return value  # a state dict a strategy or hook built itself: saved as it is, a value
    if value.untouched():
        return module
    if value.only_removed():
        kept = set(value)
        return Filtered(module, lambda name, _v: name in kept)
    return dict(value)  # changed by a hook: what it holds, as it holds it


@dataclass
class LoadPlan:
    """What :func:`load_plan` asks shardsafe for, and how the answer becomes Lightning's dict."""

    state: dict[str, Any]
    """The state handed to ``shardsafe.load``: the module, the optimizers, the generators and every value
    entry (``None``, replaced by the saved value)."""
    values: list[str]
    """The keys of the value entries, in the checkpoint's order."""
    optimizers: list[str] = field(default_factory=list)
    """The optimizer entries loaded, ``optimizer_states.<i>`` in order."""


def load_plan(
    path: str,
    kinds: Mapping[str, str],
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer] | None,
    *,
    rng: Policy | None,
) -> LoadPlan:
    """(every rank) The state a load of the checkpoint at ``path`` (its entries' ``kinds``) fills:
    ``module`` in place, ``optimizers`` (``None``: not asked for, e.g. when validating) and the generators
    (``rng``: the :class:`RNGState` policy; ``None``: not restored). Raises :class:`MissingKeysError` before
    anything is read when the checkpoint has no weights, or when ``optimizers`` are asked for and it holds
    none (a weights-only checkpoint) or another number of them."""
    if MODULE_KEY not in kinds:
        raise MissingKeysError(
            f"{path} holds no model weights ('state_dict'): it is not a Lightning checkpoint saved through "
            f"shardsafe.lightning (it holds {sorted(kinds)}). Load it with shardsafe.load(path).",
            [MODULE_KEY],
            sorted(kinds),
        )
    saved_optimizers = sorted(
        (k for k in kinds if k.startswith(OPTIMIZER_PREFIX)), key=lambda k: int(k.removeprefix(OPTIMIZER_PREFIX))
    )
    state: dict[str, Any] = {MODULE_KEY: module}
    plan = LoadPlan(state, [])
    if optimizers is not None and optimizers:
        if not saved_optimizers:
            raise MissingKeysError(
                f"{path} is a weights-only checkpoint (saved with save_weights_only=True, or weights_only=True): it "
                "holds the model but no optimizer or scheduler state, so training cannot resume from it. Nothing was "
                "loaded. Start a new fit from its weights: model = shardsafe.lightning.load_from_checkpoint("
                "ModelClass, path), then trainer.fit(model) without ckpt_path.",
                ["optimizer_states"],
                sorted(kinds),
            )
        if len(saved_optimizers) != len(optimizers):
            raise MissingKeysError(
                f"{path} holds {len(saved_optimizers)} optimizer(s), the model's configure_optimizers() gave "
                f"{len(optimizers)}; nothing was loaded. Resume with the optimizers the checkpoint was saved with.",
                [f"{OPTIMIZER_PREFIX}{i}" for i in range(len(optimizers))],
                sorted(kinds),
            )
        for key, opt in zip(saved_optimizers, optimizers, strict=True):
            state[key] = opt if kinds[key] == "optimizer" else None  # a hook's own value: Lightning loads it
        plan.optimizers = saved_optimizers
    if rng is not None and RNG_KEY in kinds:
        state[RNG_KEY] = RNGState(per_rank=rng)
    for key, kind in kinds.items():
        if key in (MODULE_KEY, RNG_KEY) or key.startswith(OPTIMIZER_PREFIX) or kind not in ("value", "stateful"):
            continue
        state[key] = None
        plan.values.append(key)
    return plan


def loaded_checkpoint(plan: LoadPlan, module: nn.Module) -> dict[str, Any]:
    """(every rank, after the load) Lightning's checkpoint dict: the values, and read-only views of the
    loaded model's and optimizers' state dicts (the hooks that read them see what was loaded; changing
    them changes nothing, as with Lightning's FSDP strategy, which also loads before the hooks)."""
    out: dict[str, Any] = {k: plan.state[k] for k in plan.values}
    out[MODULE_KEY] = MappingProxyType(module_state(module))
    if plan.optimizers:
        out["optimizer_states"] = [_view(plan.state[k]) for k in plan.optimizers]
    return out


def _view(loaded: Any) -> Any:
    if isinstance(loaded, torch.optim.Optimizer):
        return MappingProxyType(loaded.state_dict())
    return loaded  # a hook's own value, as saved: Lightning's load_optimizer_state_dict loads it


def check_hparams(trainer: Any, *, allow_pickle: bool) -> None:
    """(every rank, at the strategy's setup) Raise :class:`UnsafeValueError` naming the hyperparameter of the
    module or datamodule that a checkpoint could not hold (without ``allow_pickle``), as the first save would."""
    for obj in (trainer.lightning_module, trainer.datamodule):
        hparams = getattr(obj, "hparams", None) if obj is not None else None
        if hparams:
            encode(dict(hparams), obj.CHECKPOINT_HYPER_PARAMS_KEY, lambda path, _t: path, allow_pickle=allow_pickle)
