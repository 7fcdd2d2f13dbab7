"""What each rank runs in a benchmark session (the functions :func:`bench.ranks.run_session` spawns).

A main session (2 ranks) builds one kind of state once and runs every contender's repetitions on it, in
an order that changes every repetition (:func:`order`) so that no contender always runs first or right
after the same neighbour. It then saves, untimed, the checkpoints that the
reshard sessions (1 plain process; 3 FSDP2 ranks) load.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from typing import Any, TypeVar

from bench.contenders import RESHARDING, Contender, create
from bench.measure import Ctx
from bench.state import Kind, Layout, build

T = TypeVar("T")


@dataclass(frozen=True)
class SessionConfig:
    """What a session measures; the same object reaches every rank."""

    kind: Kind
    size_bytes: int
    reps: int
    root: str  # scratch directory for this session's checkpoints, on the disk under test
    cold: bool  # drop the page cache before every load
    contenders: tuple[str, ...]
    sources: str  # where the main session leaves, and the reshard sessions find, the reshard sources


def order(items: list[T], rep: int) -> list[T]:
    """The contenders' order in repetition ``rep``: the rows of a Williams design (a Latin square balanced
    for the neighbour before; with an odd number of contenders, its rows and then their reverses). Over
    ``2 * len(items)`` repetitions every contender runs in every position twice, before every other one
    ``len(items)`` times, and right after every other one equally often. (A plain rotation keeps the same
    neighbour before each contender, which matters: a contender run right after one that churned through
    memory or the disk is measured in a colder machine; and reversing every other rotation undoes the
    rotation of two contenders, so the same one always ran first.)"""
    n = len(items)
    if not n:
        return []
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    row = [items[(i + rep) % n] for i in first]
    return row[::-1] if n % 2 and (rep // n) % 2 else row


def _log(rank: int, message: str) -> None:
    if rank == 0:
        print(message, flush=True)


def main_session(rank: int, world: int, cfg: SessionConfig) -> dict[str, Any]:
    """(every rank of the 2-rank session) Measure every contender ``cfg.reps`` times on one state."""
    t0 = time.monotonic()
    layout: Layout = "ddp" if cfg.kind == "replicated" else "fsdp2"
    state = build(cfg.kind, layout, cfg.size_bytes)
    _log(rank, f"[{cfg.kind}] state of {state.global_bytes / 2**20:.0f} MiB built in {time.monotonic() - t0:.1f} s")
    contenders: list[Contender] = [create(name, state) for name in cfg.contenders]
    ctx = Ctx(kind=cfg.kind, rank=rank, world=world, root=cfg.root, cold=cfg.cold)
    for rep in range(cfg.reps):
        ctx.rep = rep
        for c in order(contenders, rep):
            ctx.contender = c.name
            done, t1 = len(ctx.samples), time.monotonic()
            c.rep(ctx)
            times = ", ".join(f"{s['op']} {s['seconds']:.2f}s" for s in ctx.samples[done:])
            _log(rank, f"[{cfg.kind}] rep {rep} {c.name}: {times} ({time.monotonic() - t1:.0f} s with cleanup)")
    for c in contenders:
        if c.name in RESHARDING:
            c.save_source(os.path.join(cfg.sources, c.name))
    return {
        "samples": ctx.samples,
        "global_bytes": state.global_bytes,
        "local_bytes": state.local_bytes(),
        "dim": state.dim,
    }


def reshard_session(rank: int, world: int, cfg: SessionConfig, saved_world: int) -> dict[str, Any]:
    """(every rank of a 1-process or 3-rank session) Time loading the main session's checkpoints, saved by
    ``saved_world`` ranks, into this world: a plain module on 1 process, FSDP2 on more."""
    state = build(cfg.kind, "plain" if world == 1 else "fsdp2", cfg.size_bytes)
    contenders = [create(name, state) for name in cfg.contenders if name in RESHARDING]
    ctx = Ctx(kind=cfg.kind, rank=rank, world=world, root=cfg.root, cold=cfg.cold)
    op = f"load_{saved_world}to{world}"
    for rep in range(cfg.reps):
        ctx.rep = rep
        for c in order(contenders, rep):
            ctx.contender = c.name
            source = os.path.join(cfg.sources, c.name)
            state.scramble()
            ctx.measure(op, functools.partial(c.load_resharded, source), load=True)
            state.check(f"{c.name} {op}")
            _log(rank, f"[{cfg.kind}] rep {rep} {c.name}: {op} {ctx.samples[-1]['seconds']:.2f}s")
    return {"samples": ctx.samples}
