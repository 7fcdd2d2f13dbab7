"""Run a function on N ranks (spawned processes, gloo on CPU) with a hard deadline.

Two ways of starting the ranks, as real launchers do (``store=``):

- ``"external"`` (default, as torchrun): the parent hosts the TCPStore on a port the OS picked (bound,
  never closed and reused), so a rank that dies, even rank 0, does not take the store with it;
- ``"tcp"`` / ``"env"`` (as SLURM ``srun``, ``mp.spawn`` and Lightning Fabric's launcher): every rank
  calls ``init_process_group(init_method="tcp://127.0.0.1:PORT")``, or ``"env://"`` with
  ``MASTER_ADDR``/``MASTER_PORT``, and rank 0 hosts the TCPStore: when rank 0's process ends, the
  store goes with it.

Every run has a deadline: ranks still alive at the end are killed, and their outcome says so.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class Outcome:
    rank: int
    exitcode: int | None = None
    result: Any = None
    error_type: str | None = None
    error: str | None = None
    traceback: str | None = None
    error_mro: list[str] = field(default_factory=list)
    elapsed: float | None = None
    killed: bool = False

    @property
    def ok(self) -> bool:
        return self.exitcode == 0 and self.error_type is None


PORT_TAKEN = "port-taken"
"""What rank 0 reports when the port it was to host the store on was taken meanwhile by another
process (``free_port`` can only say it was free then): the world starts again on another port."""


def _join(rank: int, world: int, port: int, store_mode: str) -> None:
    """Join the gloo process group as ``store_mode`` says (module docstring)."""
    if store_mode == "external":
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=120))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    elif store_mode == "tcp":  # rank 0 hosts the store (SLURM srun, mp.spawn)
        method = f"tcp://127.0.0.1:{port}"
        dist.init_process_group("gloo", init_method=method, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    elif store_mode == "env":  # rank 0 hosts the store (MASTER_ADDR/MASTER_PORT, Lightning's launcher)
        dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))
    else:
        raise ValueError(f"store={store_mode!r} is not external, tcp or env")


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    port: int,
    args: tuple[Any, ...],
    env: dict[str, str],
    q: Any,
    store_mode: str = "external",
) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks (gloo): a visible GPU must not be picked up
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch

    torch.set_num_threads(1)
    start = time.monotonic()
    try:
        _join(rank, world, port, store_mode)
    except Exception as err:
        if rank == 0 and store_mode != "external" and "EADDRINUSE" in str(err):  # taken since free_port()
            q.put((rank, PORT_TAKEN, None, type(err).__name__, str(err), None, [], time.monotonic() - start))
            return
        raise
    try:
        result = fn(rank, world, *args)
        buf = io.BytesIO()
        torch.save(result, buf)  # tensors by value: a queue would pass file descriptors of a dying process
        q.put((rank, "ok", buf.getvalue(), None, None, None, [], time.monotonic() - start))
    except BaseException as err:  # reported to the parent, which decides what the test expects
        mro = [c.__name__ for c in type(err).__mro__]
        q.put(
            (
                rank,
                "err",
                None,
                type(err).__name__,
                str(err),
                traceback.format_exc(),
                mro,
                time.monotonic() - start,
            )
        )
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


# Ranks fork from a server process that has imported torch already: a fraction of a second per rank
# instead of seconds (Lightning too, where installed: the Trainer tests' ranks). A rank's environment goes
# through ``env``/``rank_env`` (the server keeps the environment it started with).
_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed.fsdp", "shardsafe", "harness", "models", "lightning.pytorch"])


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    rank_env: dict[int, dict[str, str]] | None = None,
    store: str = "external",
) -> list[Outcome]:
    """Run ``fn(rank, world, *args)`` on ``world`` fresh processes; return each rank's outcome.
    ``store`` says who hosts the rendezvous store (module docstring). A world whose rank 0 found its
    store's port taken by another process (:data:`PORT_TAKEN`) is started again, at most 3 times."""
    for _ in range(3):
        outcomes = _run_once(fn, world, args, timeout, env, rank_env, store)
        if outcomes is not None:
            return outcomes
    raise RuntimeError(f"rank 0 found the store's port taken 3 times in a row (store={store!r})")


def _run_once(
    fn: Callable[..., Any],
    world: int,
    args: tuple[Any, ...],
    timeout: float,
    env: dict[str, str] | None,
    rank_env: dict[int, dict[str, str]] | None,
    store: str,
) -> list[Outcome] | None:
    """One try of :func:`run_ranks`; ``None`` when rank 0 found its port taken (the others are killed)."""
    ctx = _CTX
    host: Any = None
    if store == "external":
        host = dist.TCPStore(
            "127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120)
        )
        port = host.port
    else:
        port = free_port()
    q = ctx.Queue()
    procs = []
    for r in range(world):
        e = {**(env or {}), **((rank_env or {}).get(r, {}))}
        p = ctx.Process(target=_entry, args=(fn, r, world, port, args, e, q, store), daemon=True)
        p.start()
        procs.append(p)
    outcomes = {r: Outcome(rank=r) for r in range(world)}
    deadline = time.monotonic() + timeout
    pending = set(range(world))
    while pending and time.monotonic() < deadline:
        try:
            rank, kind, result, etype, emsg, tb, mro, elapsed = q.get(timeout=0.2)
            if kind == PORT_TAKEN:
                for p in procs:
                    p.kill()
                    p.join(5)
                return None
            o = outcomes[rank]
            if result is not None:
                result = torch.load(io.BytesIO(result), weights_only=False)
            o.result, o.error_type, o.error, o.traceback, o.error_mro, o.elapsed = (
                result,
                etype,
                emsg,
                tb,
                mro,
                elapsed,
            )
            pending.discard(rank)
        except queue.Empty:
            pass
        for r in list(pending):
            if not procs[r].is_alive() and procs[r].exitcode is not None:
                # died without reporting (os._exit / SIGKILL); drain a late message first
                time.sleep(0.05)
                if q.empty():
                    pending.discard(r)
    for r, p in enumerate(procs):
        p.join(timeout=max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5)
            outcomes[r].killed = True
        outcomes[r].exitcode = p.exitcode
    del host
    return [outcomes[r] for r in range(world)]


def free_port() -> int:
    """A port the OS reports free now, for a rank 0 that hosts the store (as a launcher picks one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_ok(outcomes: list[Outcome]) -> list[Any]:
    """Assert every rank succeeded; return their results."""
    bad = [o for o in outcomes if not o.ok]
    assert not bad, "\n".join(
        f"rank {o.rank}: exit={o.exitcode} killed={o.killed} {o.error_type}: {o.error}\n{o.traceback}" for o in bad
    )
    return [o.result for o in outcomes]
