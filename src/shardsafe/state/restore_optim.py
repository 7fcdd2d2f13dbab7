"""Loading an optimizer entry (every rank, locally; part of a :class:`~shardsafe.state.restore.Restorer`
plan). The saved entry is validated whole first (a malformed one is a CorruptCheckpointError before
anything changes); its state is keyed by parameter name, so it maps onto the optimizer's parameters
whatever the wrapping and the world size. Tensors of the optimizer's current state are filled in place
when shape and dtype agree; the others are read into new tensors shaped like their parameter (a DTensor
shard under FSDP2) or as saved. Tensors in ``param_groups`` (``lr=torch.tensor(...)``) come back as
tensors. An optimizer over FSDP1 parameters has its state placed by state/fsdp1_load.py (this rank's
range of each parameter). After the reads, ``load_optimizer_state`` hands it all to the optimizer.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from shardsafe.errors import CorruptCheckpointError
from shardsafe.format.values import decode
from shardsafe.format.walk import has_per_rank
from shardsafe.state import fsdp1_load
from shardsafe.state.flatten import load_optimizer_state, optimizer_current, param_names
from shardsafe.state.fsdp1 import Fsdp1State
from shardsafe.state.restore import Op, Restorer

Json = Any
Entries = list[tuple[str, Json]]


class SavedOptimizer(NamedTuple):
    """A saved optimizer entry, validated: ``state`` lists ``(parameter name, [(key, node)])``,
    ``groups`` lists ``(parameter names, [(hyperparameter, node)])``."""

    state: list[tuple[str, Entries]]
    groups: list[tuple[list[str], Entries]]


def _items(node: Json, where: str, what: str) -> list[tuple[Any, Json]]:
    if not (isinstance(node, dict) and node.get("$") == "dict" and isinstance(node.get("items"), list)):
        raise CorruptCheckpointError(f"{where}: {what} is not a dict")
    return [(k, v) for k, v in node["items"]]


def parse_optimizer(node: Json, where: str) -> SavedOptimizer:
    """The saved optimizer entry, parsed. Raises :class:`CorruptCheckpointError` naming what is
    malformed."""
    top = dict(_items(node, where, "the optimizer entry"))
    if set(top) != {"state", "param_groups"}:
        raise CorruptCheckpointError(f"{where}: an optimizer entry holds 'state' and 'param_groups', not {sorted(top)}")
    state = []
    for pname, pnode in _items(top["state"], where, "'state'"):
        if not isinstance(pname, str):
            raise CorruptCheckpointError(f"{where}: state key {pname!r} is not a parameter name")
        entries = _items(pnode, f"{where}/state/{pname}", "a parameter's state")
        if any(not isinstance(k, str) for k, _ in entries):
            raise CorruptCheckpointError(f"{where}/state/{pname}: keys must be strings")
        state.append((pname, entries))
    if not isinstance(top["param_groups"], list):
        raise CorruptCheckpointError(f"{where}: 'param_groups' is not a list")
    groups = []
    for g, gnode in enumerate(top["param_groups"]):
        entries = _items(gnode, f"{where}/param_groups/{g}", "a parameter group")
        names = dict(entries).get("params")
        if not (isinstance(names, list) and all(isinstance(n, str) for n in names) and len(set(names)) == len(names)):
            raise CorruptCheckpointError(
                f"{where}/param_groups/{g}: 'params' is not a list of distinct parameter names"
            )
        groups.append((names, [(k, v) for k, v in entries if k != "params"]))
    return SavedOptimizer(state, groups)


def plan_optimizer(r: Restorer, key: str, opt: torch.optim.Optimizer, node: Json, state: Mapping[str, Any]) -> None:
    """Plan restoring optimizer ``opt`` (entry ``key``) into ``r``; a mismatch of its parameters with
    the saved ones is recorded as missing (``strict`` decides), never half applied."""
    where = f"{r.path}: {key}"
    saved = parse_optimizer(node, where)
    r.cpu_only = True  # torch's load_state_dict places state by its parameter (``step`` stays on CPU)
    try:
        planned = _plan_groups(r, key, opt, saved, state)
    finally:
        r.cpu_only = False
    if planned is not None and type(opt).load_state_dict is torch.optim.Optimizer.load_state_dict:
        _trial(r, where, opt, saved, *planned)


def _trial(
    r: Restorer,
    where: str,
    opt: torch.optim.Optimizer,
    saved: SavedOptimizer,
    index: dict[str, int],
    group_params: list[list[int]],
) -> None:
    """(planning, before anything changes) Hand the saved entry to ``load_state_dict`` of a shallow copy
    of ``opt`` (its own ``__dict__``, no hooks), tensors stood in by empty ones of the saved dtype: a
    well-formed entry the optimizer refuses (a string where it needs a number) is then found before
    the go/no-go, not after the model was filled. State is keyed by the optimizer's own parameter
    indices (``index``: saved name -> index; several names share the index of an FSDP1 flat parameter)."""

    def stand_in(ref: str) -> torch.Tensor:
        return torch.empty(0, dtype=r.manifest.tensors[ref].dtype)

    def value(node: Json, here: str) -> Any:
        return decode(node, here, stand_in, allow_pickle=r.allow_pickle)

    if any(has_per_rank(v) for _, entries in saved.state for _, v in entries):
        return  # per-rank optimizer state: its rank's value is chosen at restore; nothing to try here
    trial = {
        "state": {index[p]: {k: value(v, f"{where}/state/{p}/{k}") for k, v in entries} for p, entries in saved.state},
        "param_groups": [
            {**{k: value(v, f"{where}/param_groups/{k}") for k, v in entries}, "params": params}
            for (_, entries), params in zip(saved.groups, group_params, strict=True)
        ],
    }
    shadow = copy.copy(opt)
    shadow._optimizer_load_state_dict_pre_hooks = OrderedDict()
    shadow._optimizer_load_state_dict_post_hooks = OrderedDict()
    try:
        shadow.load_state_dict(trial)
    except Exception as err:
        raise CorruptCheckpointError(
            f"{where}: the optimizer ({type(opt).__name__}) refuses the saved state ({type(err).__name__}: "
            f"{str(err)[:200]}); nothing was loaded. The checkpoint was damaged, or saved from another optimizer."
        ) from err


def _names(opt: torch.optim.Optimizer, names: dict[int, str], fsdp: Fsdp1State | None) -> list[list[str]]:
    """Per parameter of ``opt`` (in order), the names its saved state goes by: its name (positional
    ``group<g>.<i>`` when unknown), or those of the original parameters of an FSDP1 parameter."""
    out = []
    for g, group in enumerate(opt.param_groups):
        for i, p in enumerate(group["params"]):
            out.append(
                fsdp.names_of(p) if fsdp is not None and fsdp.manages(p) else [names.get(id(p), f"group{g}.{i}")]
            )
    return out


def _plan_groups(
    r: Restorer,
    key: str,
    opt: torch.optim.Optimizer,
    saved: SavedOptimizer,
    state: Mapping[str, Any],
) -> tuple[dict[str, int], list[list[int]]] | None:
    """Plan the restore; returns (saved name -> parameter index, the indices of each group), or
    ``None`` when the optimizer's parameters differ from the saved ones (recorded as missing)."""
    fsdp = fsdp1_load.context(state, opt)  # None unless ``opt`` holds FSDP1 parameters
    per_param = _names(opt, param_names(state), fsdp)
    group_params: list[list[int]] = []
    for group in opt.param_groups:
        start = sum(len(g) for g in group_params)
        group_params.append(list(range(start, start + len(group["params"]))))
    group_names = [[n for i in g for n in per_param[i]] for g in group_params]
    if len(saved.groups) != len(group_names) or any(
        sorted(s) != sorted(g) for (s, _), g in zip(saved.groups, group_names, strict=False)
    ):
        r.missing.append(f"{key}: parameter groups differ (saved {[s for s, _ in saved.groups]}, now {group_names})")
        return None
    index = {n: i for i, ns in enumerate(per_param) for n in ns}
    unknown = [n for n, _ in saved.state if n not in index]
    if unknown:
        r.missing.append(f"{key}: state for parameters the optimizer does not have: {unknown}")
        return None
    params = [p for g in opt.param_groups for p in g["params"]]
    by_name = dict(saved.state)
    current = optimizer_current(opt)
    state_ops: dict[int, list[tuple[str, Op]]] = {}
    for i, p in enumerate(params):
        now = current["state"].get(i, {})
        if fsdp is not None and fsdp.manages(p):
            ops = fsdp1_load.plan_state(r, fsdp, p, now, by_name, f"{key}/state")
        elif per_param[i][0] in by_name:
            ops = _state(r, p, now, by_name[per_param[i][0]], f"{key}/state/{per_param[i][0]}")
        else:
            ops = None
        if ops is not None:
            state_ops[i] = ops
    group_ops = []
    for (_, entries), now_group in zip(saved.groups, current["param_groups"], strict=True):
        ops = []
        for k, v in entries:
            here = f"{key}/param_groups/{k}"
            new = r.merge(now_group[k], v, here, lenient=True) if k in now_group else r.replace(v, here)
            if new is not None:
                ops.append((k, new))
        group_ops.append(ops)

    def apply() -> None:
        load_optimizer_state(
            opt,
            {
                "state": {i: {k: op() for k, op in ops} for i, ops in state_ops.items()},
                "param_groups": [
                    {**{k: op() for k, op in ops}, "params": p} for ops, p in zip(group_ops, group_params, strict=True)
                ],
            },
        )

    r.steps.append(apply)
    return index, group_params


def _state(
    r: Restorer, param: torch.Tensor, now: Mapping[str, Any], entries: list[tuple[str, Json]], where: str
) -> list[tuple[str, Op]]:
    """One parameter's state: into its current state in place where it agrees, else new."""
    ops = []
    for k, v in entries:
        here = f"{where}/{k}"
        if k in now:
            ops.append((k, r.merge(now[k], v, here, lenient=True)))
        elif _tag(v) == "tensor" and r.manifest.tensors[v["ref"]].shape == tuple(param.shape):
            ops.append((k, r.fresh(v["ref"], _like(param, r.manifest.tensors[v["ref"]].dtype), like=param)))
        else:
            new = r.replace(v, here)
            if new is not None:
                ops.append((k, new))
    return ops


def _like(param: torch.Tensor, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    """A new state tensor placed like its parameter (device; a DTensor's mesh and placements)."""
    return lambda: torch.zeros_like(param.detach(), dtype=dtype)


def _tag(node: Json) -> str | None:
    return node.get("$") if isinstance(node, dict) else None
