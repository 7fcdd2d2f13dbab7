"""Optimizer state of FSDP1 parameters, planned into a :class:`~shardsafe.state.restore.Restorer`
(every rank, locally, while planning; called by state/restore_optim.py for each parameter FSDP1
manages). How a rank holds a parameter: state/fsdp1.py.

- ``use_orig_params=True``: the optimizer holds each original parameter as a 1-D view of this rank's
  range of it, and keeps its state tensors shaped the same. A saved state tensor shaped like the
  parameter is read into the boxes of that range: into the optimizer's own tensor, in place, when it
  has one of the saved dtype; else into a new one. A rank holding none of a parameter gets no state
  for it, as FSDP1 keeps none.
- ``use_orig_params=False``: the optimizer holds the flat parameter, with one state for all the
  original parameters in it, assembled from theirs: tensors shaped like their parameter go into their
  range of the flat state; anything else (``step``) must be equal for all of them. Tensors among those
  are read before the go/no-go (into new tensors) and compared there (:attr:`Restorer.checks`), so a
  mismatch refuses the load with nothing changed.

Everything else is restored as for any optimizer, and handed to its own ``load_state_dict``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from shardsafe.errors import StateMismatchError
from shardsafe.state.flatten import modules_of
from shardsafe.state.fsdp1 import Fsdp1State, _Param, is_fsdp1
from shardsafe.state.nodes import refs
from shardsafe.state.restore import Op, Restorer

Json = Any
Saved = Mapping[str, list[tuple[str, Json]]]
"""saved parameter name -> its state, [(key, typed JSON node)]"""


def context(state: Mapping[str, Any], opt: torch.optim.Optimizer) -> Fsdp1State | None:
    """The FSDP1 modules of ``state``, when ``opt`` holds parameters of theirs; else None."""
    modules = modules_of(state)
    roots = {k: m for k, m in modules if is_fsdp1(m)}
    if not roots:
        return None
    ctx = Fsdp1State(roots, multi=len(modules) > 1)
    return ctx if ctx.touches(opt) else None


def plan_state(
    r: Restorer, ctx: Fsdp1State, p: torch.Tensor, now: Mapping[str, Any], saved: Saved, where: str
) -> list[tuple[str, Op]] | None:
    """The state of optimizer parameter ``p`` (FSDP1 manages it), as ``(key, op)``; ``now`` is its
    current state, ``where`` names the optimizer's state in messages. None: no state for it."""
    if id(p) not in ctx.by_orig:
        return _flat(r, ctx.by_flat[id(p)], p, now, saved, where)
    oname, q = ctx.by_orig[id(p)]
    entries = saved.get(oname)
    if entries is None or q.hi == q.lo:  # FSDP1 keeps no state for a parameter this rank holds none of
        return None
    ops = []
    for k, v in entries:
        here = f"{where}/{oname}/{k}"
        op = _shard(r, [(q, v)], p, now.get(k), 0, here) or _usual(r, k, v, now, here)
        if op is not None:
            ops.append((k, op))
    return ops


def _flat(
    r: Restorer, members: list[tuple[str, _Param]], p: torch.Tensor, now: Mapping[str, Any], saved: Saved, where: str
) -> list[tuple[str, Op]] | None:
    """``use_orig_params=False``: one state for the flat parameter ``p``, from its members' states."""
    names = [o for o, _ in members]
    have = [o for o in names if o in saved]
    if not have:
        return None
    if len(have) != len(members):
        raise StateMismatchError(
            f"{r.path}: {where}: the checkpoint has optimizer state for {have} but not for "
            f"{[o for o in names if o not in saved]}, which share one FSDP1 flat parameter (use_orig_params=False) "
            "and so one state; nothing was loaded. Load with use_orig_params=True."
        )
    states = [dict(saved[o]) for o in names]
    keys = list(states[0])
    for o, st in zip(names, states, strict=True):
        if list(st) != keys:
            raise StateMismatchError(
                f"{r.path}: {where}/{o}: optimizer state keys {list(st)}, not {keys} as for {names[0]}, which shares "
                "its FSDP1 flat parameter (use_orig_params=False); nothing was loaded. Load with use_orig_params=True."
            )
    ops = []
    for k in keys:
        nodes = [st[k] for st in states]
        here = f"{where}/{names[0]}/{k}"
        op = _shard(r, [(q, n) for (_, q), n in zip(members, nodes, strict=True)], p, now.get(k), None, here)
        if op is None and any(refs(n) for n in nodes):  # ``step`` tensors: compared once read, before the go
            values = [r.replace(n, f"{where}/{o}/{k}", early=True) for o, n in zip(names, nodes, strict=True)]
            if any(v is None for v in values):
                continue  # per-rank state this rank has none of (recorded as missing)
            r.checks.append(_agree(r, [v for v in values if v is not None], names, f"{where}: {k!r}"))
            op = values[0]
        elif op is None:
            if any(n != nodes[0] for n in nodes):
                raise StateMismatchError(
                    f"{r.path}: {where}: {k!r} differs between {names} ({[str(n)[:40] for n in nodes]}), which share "
                    "one FSDP1 flat parameter (use_orig_params=False) and so one state; nothing was loaded. Load "
                    "with use_orig_params=True."
                )
            op = _usual(r, k, nodes[0], now, here)
        if op is not None:
            ops.append((k, op))
    return ops


def _shard(
    r: Restorer, parts: list[tuple[_Param, Json]], p: torch.Tensor, current: Any, start: int | None, where: str
) -> Op | None:
    """State tensors shaped like their original parameters, read into this rank's ranges of a tensor
    shaped like ``p`` (each part at ``start``, or at its own place in the flat shard when None): the
    optimizer's ``current`` tensor in place when it fits, else a new one. None when the first saved
    node is not a tensor shaped like its parameter (another kind of state)."""
    first_q, first = parts[0]
    if not (isinstance(first, dict) and first.get("$") == "tensor"):
        return None
    dtype = r.manifest.tensors[first["ref"]].dtype
    if r.manifest.tensors[first["ref"]].shape != first_q.shape:
        return None
    fits = (
        isinstance(current, torch.Tensor)
        and type(current) is torch.Tensor
        and current.dtype == dtype
        and current.shape == p.shape
        and current.device == p.device
        and current.is_contiguous()
    )
    dest = current if fits else torch.zeros(p.shape, dtype=dtype, device=p.device)
    for q, node in parts:
        if not (isinstance(node, dict) and node.get("$") == "tensor"):
            raise StateMismatchError(
                f"{r.path}: {where}: {q.name} holds no tensor here, unlike {first_q.name}, which shares its FSDP1 "
                "flat parameter; nothing was loaded. Load with use_orig_params=True."
            )
        layout = q.layout(dest.view(-1), q.at if start is None else start)
        r.fill(node["ref"], layout, where, private=not fits)
    return lambda: dest


def _usual(r: Restorer, k: str, v: Json, now: Mapping[str, Any], where: str) -> Op | None:
    """State that is not shaped like the parameter (``step``): as for any optimizer."""
    return r.merge(now[k], v, where, lenient=True) if k in now else r.replace(v, where)


def _agree(r: Restorer, values: list[Op], names: list[str], where: str) -> Callable[[], None]:
    def check() -> None:
        got = [op() for op in values]
        if not all(_same(got[0], g) for g in got[1:]):
            raise StateMismatchError(
                f"{r.path}: {where} differs between {names} ({[str(g)[:40] for g in got]}), which share one FSDP1 "
                "flat parameter (use_orig_params=False) and so one state; nothing was loaded. Load with "
                "use_orig_params=True."
            )

    return check


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)
