"""What an imported state is saved as, so that ``shardsafe.load`` resumes from it as from its own saves.

shardsafe keys an optimizer's state by parameter name (state/flatten.py): ``{"state": {name: {...}},
"param_groups": [{..., "params": [names]}]}``, the names being those of the one module saved beside it.
DCP checkpoints made with ``get_state_dict(model, optimizer)`` hold exactly that, but as plain dicts, which
an import would save as plain values: a load into ``{"model": model, "optim": optimizer}`` then refuses
the optimizer entry. So an entry of that shape whose parameter names are all tensors of one state-dict
entry (a dict of name -> tensor) is saved as an optimizer, and that state-dict entry as a module: the
tensors are the same objects, put in a module whose parameter names are the dict's keys, and the optimizer
is a ``torch.optim.Optimizer`` over those parameters holding the saved state. Anything else (an
index-keyed ``optimizer.state_dict()`` as ``torch.save`` files hold, names that do not fit a module) is
saved as it was, and said so.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)


def shape(entries: dict[str, Any], where: str) -> dict[str, Any]:
    """``entries`` with name-keyed optimizer entries (and the state dict they refer to) turned into an
    optimizer and a module; the rest unchanged."""
    optimizers = {k: v for k, v in entries.items() if _named_optimizer(v)}
    if not optimizers:
        return entries
    if any(isinstance(v, (nn.Module, torch.optim.Optimizer)) for v in entries.values()):
        logger.warning(
            "shardsafe import: %s holds modules or optimizers besides its state dicts; optimizer entries %s are "
            "imported as plain values",
            where,
            sorted(optimizers),
        )
        return entries
    wanted = {n for v in optimizers.values() for g in v["param_groups"] for n in g["params"]}
    owners = [k for k, v in entries.items() if _state_dict(v) and wanted <= set(v)]
    module = _module(entries[owners[0]]) if len(owners) == 1 else None
    built = {k: _optimizer(module, v) for k, v in optimizers.items()} if module is not None else {}
    if module is None or not all(o is not None for o in built.values()):
        logger.warning(
            "shardsafe import: %s: optimizer entries %s are keyed by parameter name, but their parameters are not "
            "the tensors of one state-dict entry (found in: %s); imported as plain values (load(path) reads them)",
            where,
            sorted(optimizers),
            owners or "none",
        )
        return entries
    logger.info(
        "shardsafe import: %s: %s saved as a module and %s as its optimizer%s: resumable with load(path, state)",
        where,
        owners[0],
        ", ".join(sorted(built)),
        "s" if len(built) > 1 else "",
    )
    return {k: module if k == owners[0] else built.get(k, v) for k, v in entries.items()}


def _named_optimizer(value: Any) -> bool:
    """``{"state": {name: {key: value}}, "param_groups": [{..., "params": [names]}]}``, names distinct."""
    if not (isinstance(value, Mapping) and set(value) == {"state", "param_groups"}):
        return False
    state, groups = value["state"], value["param_groups"]
    if not (isinstance(state, Mapping) and isinstance(groups, list) and groups):
        return False
    names: list[Any] = []
    for g in groups:
        if not (isinstance(g, Mapping) and isinstance(g.get("params"), list)):
            return False
        if not all(isinstance(k, str) for k in g):
            return False
        names += g["params"]
    if not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
        return False
    return all(k in names and isinstance(v, Mapping) and all(isinstance(x, str) for x in v) for k, v in state.items())


def _state_dict(value: Any) -> bool:
    return (
        isinstance(value, Mapping)
        and len(value) > 0
        and all(isinstance(k, str) and k for k in value)
        and all(isinstance(v, torch.Tensor) for v in value.values())
    )


def _module(sd: Mapping[str, torch.Tensor]) -> nn.Module | None:
    """A module whose parameters are the tensors of ``sd`` (the same storage) under its names, or
    ``None`` when the names cannot be a module's (a name both a tensor and a prefix, an attribute that
    ``nn.Module`` itself has)."""
    root = nn.Module()
    try:
        for name, t in sd.items():
            *path, leaf = name.split(".")
            here = root
            for part in path:
                child = here._modules.get(part)
                if child is None:
                    child = nn.Module()
                    here.add_module(part, child)
                here = child
            here.register_parameter(leaf, nn.Parameter(t.detach(), requires_grad=False))
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError):
        return None
    return root if set(root.state_dict()) == set(sd) else None


def _optimizer(module: nn.Module, saved: Mapping[str, Any]) -> torch.optim.Optimizer | None:
    """A base ``torch.optim.Optimizer`` over ``module``'s parameters holding ``saved``'s groups and state
    (never stepped: it only carries the state into the checkpoint)."""
    params = dict(module.named_parameters())
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [params[n] for n in g["params"]]}
        for g in saved["param_groups"]
    ]
    try:
        opt = torch.optim.Optimizer(groups, {})
    except (TypeError, ValueError, RuntimeError):
        return None
    for name, state in saved["state"].items():
        opt.state[params[name]] = dict(state)
    return opt
