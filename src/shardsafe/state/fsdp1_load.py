"""Restoring FSDP1 modules and their optimizers (see :mod:`shardsafe.state.fsdp1` for the layout).

Module parameters are read straight into views of each rank's flat shard (in place, no collective).
Optimizer state is read into new tensors shaped as FSDP1 keeps it (1-D per original parameter with
``use_orig_params=True``, one flat tensor per unit without), then handed to the optimizer's own
``load_state_dict``. A rank that holds none of a parameter gets no state for it, as FSDP1 itself does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from shardsafe.errors import CheckpointError
from shardsafe.state.fsdp1 import Fsdp1State, Read, _other_tensors, _Param, is_fsdp1
from shardsafe.state.layout import Layout, layout_of

Shapes = Mapping[str, tuple[tuple[int, ...], torch.dtype]]
"""checkpoint tensor name -> (global shape, dtype)"""


def module_destinations(module: nn.Module) -> dict[str, Layout] | None:
    """(every rank, locally) Where each entry of an FSDP1 module's state dict lives on this rank,
    by clean name; None when ``module`` holds no FSDP1 unit."""
    if not is_fsdp1(module):
        return None
    state = Fsdp1State({"": module}, multi=False)
    params = state.params[""]
    out: dict[str, Layout] = {}
    for q in params:
        layout = q.layout(q.flat.detach(), q.at)
        for name in (q.name, *q.aliases):
            out[name] = layout
    for name, t in _other_tensors(module, params).items():
        out[name] = layout_of(t)
    return out


def _is_ref(v: Any, shapes: Shapes) -> bool:
    return isinstance(v, str) and v in shapes


def plan_optimizer_load(
    opt: torch.optim.Optimizer,
    saved: dict[str, Any],
    shapes: Shapes,
    roots: Mapping[str, nn.Module],
    names: dict[int, str],
    read: Read,
    where: str,
) -> tuple[list[str], Callable[[], None]] | None:
    """(every rank, locally; nothing is modified until the returned callable runs, after the reads)
    Plan restoring ``opt`` from ``saved`` (its entry decoded with tensors left as checkpoint names).
    Returns (problems, apply), or None when ``opt`` holds no FSDP1 parameter. ``roots`` are the
    modules of the state by key; ``names`` maps other parameters to names as the save did."""
    fsdp_roots = {k: m for k, m in roots.items() if is_fsdp1(m)}
    if not fsdp_roots:
        return None
    ctx = Fsdp1State(fsdp_roots, multi=len(roots) > 1)
    if not ctx.touches(opt):
        return None
    saved_state: dict[str, Any] = saved.get("state", {})
    saved_groups: list[dict[str, Any]] = saved.get("param_groups", [])
    group_names: list[list[str]] = []
    plain_names: dict[int, str] = {}  # parameters FSDP1 does not manage, by id
    for g, group in enumerate(opt.param_groups):
        gnames: list[str] = []
        for i, p in enumerate(group["params"]):
            if id(p) in ctx.by_flat:
                gnames += [oname for oname, _ in ctx.by_flat[id(p)]]
            elif id(p) in ctx.by_orig:
                gnames.append(ctx.by_orig[id(p)][0])
            else:
                gnames.append(names.get(id(p), f"group{g}.{i}"))
                plain_names[id(p)] = gnames[-1]
        group_names.append(gnames)
    if len(saved_groups) != len(group_names) or any(
        sorted(s["params"]) != sorted(g) for s, g in zip(saved_groups, group_names, strict=False)
    ):
        return [f"{where}: parameter groups differ (saved {[s['params'] for s in saved_groups]}, now {group_names})"], (
            lambda: None
        )
    known = {n for g in group_names for n in g}
    unknown = [n for n in saved_state if n not in known]
    if unknown:
        return [f"{where}: state for parameters the optimizer does not have: {unknown}"], (lambda: None)

    new_state: dict[int, dict[str, Any]] = {}
    checks: list[tuple[str, list[torch.Tensor]]] = []
    flat_params = [p for g in opt.param_groups for p in g["params"]]
    for index, p in enumerate(flat_params):
        if id(p) in ctx.by_flat:
            entry = _flat_entry(p, ctx.by_flat[id(p)], saved_state, shapes, read, checks, where)
        elif id(p) in ctx.by_orig:
            oname, q = ctx.by_orig[id(p)]
            st = saved_state.get(oname)
            if st is None or q.hi == q.lo:  # FSDP1 keeps no state for a parameter this rank holds none of
                continue
            entry = {
                k: _one(v, q, torch.zeros(p.shape, dtype=_dtype(v, shapes)), 0, shapes, read, f"{where}/{oname}/{k}")
                if _is_ref(v, shapes)
                else v
                for k, v in st.items()
            }
        else:
            st = saved_state.get(plain_names[id(p)])
            if st is None:
                continue
            entry = {k: _plain(v, p, shapes, read, f"{where}/{k}") if _is_ref(v, shapes) else v for k, v in st.items()}
        if entry is not None:
            new_state[index] = entry
    groups = []
    start = 0
    for s, group in zip(saved_groups, opt.param_groups, strict=True):
        n = len(group["params"])
        groups.append({**{k: v for k, v in s.items() if k != "params"}, "params": list(range(start, start + n))})
        start += n

    def apply() -> None:
        for what, tensors in checks:
            if any(not torch.equal(tensors[0], t) for t in tensors[1:]):
                raise CheckpointError(
                    f"{where}: {what} differs between the parameters of one FSDP1 flat parameter, which holds a "
                    "single value for all of them; load with use_orig_params=True"
                )
        opt.load_state_dict({"state": new_state, "param_groups": groups})

    return [], apply


def _dtype(v: str, shapes: Shapes) -> torch.dtype:
    return shapes[v][1]


def _one(v: str, q: _Param, dest: torch.Tensor, start: int, shapes: Shapes, read: Read, where: str) -> torch.Tensor:
    """Read checkpoint tensor ``v`` into ``dest``: this rank's range of ``q`` if it is shaped like the
    parameter, else the whole tensor (replaced by a new one of the saved shape)."""
    shape, dtype = shapes[v]
    if shape == q.shape:
        read(v, q.layout(dest, start), where)
        return dest
    whole = torch.empty(shape, dtype=dtype)
    read(v, layout_of(whole), where)
    return whole


def _plain(v: str, p: torch.Tensor, shapes: Shapes, read: Read, where: str) -> torch.Tensor:
    shape, dtype = shapes[v]
    dest = torch.zeros_like(p.detach(), dtype=dtype) if shape == tuple(p.shape) else torch.empty(shape, dtype=dtype)
    read(v, layout_of(dest), where)
    return dest


def _flat_entry(
    p: torch.Tensor,
    members: list[tuple[str, _Param]],
    saved_state: Mapping[str, Any],
    shapes: Shapes,
    read: Read,
    checks: list[tuple[str, list[torch.Tensor]]],
    where: str,
) -> dict[str, Any] | None:
    """use_orig_params=False: one state for the flat parameter, assembled from its members' states."""
    have = [oname for oname, _ in members if oname in saved_state]
    if not have:
        return None
    if len(have) != len(members):
        lacking = [oname for oname, _ in members if oname not in saved_state]
        raise CheckpointError(
            f"{where}: the checkpoint has optimizer state for {have} but not for {lacking}, which share one FSDP1 "
            "flat parameter (use_orig_params=False) and so one state; load with use_orig_params=True"
        )
    keys = list(saved_state[members[0][0]])
    for oname, _ in members:
        if list(saved_state[oname]) != keys:
            raise CheckpointError(f"{where}: {oname} has optimizer state keys {list(saved_state[oname])}, not {keys}")
    entry: dict[str, Any] = {}
    for k in keys:
        first = saved_state[members[0][0]][k]
        if _is_ref(first, shapes) and shapes[first][0] == members[0][1].shape:
            dest = torch.zeros(p.shape, dtype=_dtype(first, shapes))
            for oname, q in members:
                v = saved_state[oname][k]
                if not _is_ref(v, shapes) or shapes[v][0] != q.shape:
                    raise CheckpointError(f"{where}/{oname}/{k}: not shaped like the parameter, unlike {members[0][0]}")
                read(v, q.layout(dest, q.at), f"{where}/{oname}/{k}")
            entry[k] = dest
        elif _is_ref(first, shapes):
            copies = [
                _one(saved_state[o][k], q, torch.empty(0), 0, shapes, read, f"{where}/{o}/{k}") for o, q in members
            ]
            checks.append((repr(k), copies))
            entry[k] = copies[0]
        else:
            values = [saved_state[o][k] for o, _ in members]
            if any(v != first for v in values):
                raise CheckpointError(f"{where}: {k!r} differs between {[o for o, _ in members]}: {values}")
            entry[k] = first
    return entry
