"""Start a benchmark session on N spawned ranks (gloo on CPU) and collect what each rank returns.

The parent hosts the TCPStore, as under torchrun, so a rank that dies does not take the store with it.
A session has a deadline: ranks still alive at its end are killed and the session raises, naming them.
With ``process_group=False`` (the one-process reshard loads) no process group is created at all.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

SessionFn = Callable[..., Any]


class SessionError(RuntimeError):
    """A rank of a benchmark session failed, died or ran past the session's deadline."""


def _entry(fn: SessionFn, rank: int, world: int, port: int, process_group: bool, args: tuple[Any, ...], q: Any) -> None:
    # The same variables torchrun sets, so that peers which read them (Lightning Fabric) find this rank.
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    # One compute thread per rank: the ranks share the machine's cores, as they would share a node.
    torch.set_num_threads(1)
    try:
        if process_group:
            store = dist.TCPStore(  # type: ignore[attr-defined]
                "127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=300)
            )
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        result = fn(rank, world, *args)
        q.put((rank, True, result))
    except BaseException:  # reported to the parent, which raises it with the rank's traceback
        q.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_session(fn: SessionFn, world: int, *args: Any, timeout: float, process_group: bool = True) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` fresh spawned processes; return each rank's result.

    Waits at most ``timeout`` seconds for all ranks. Raises :class:`SessionError` with every failing
    rank's traceback if a rank raised, exited without a result, or was still running at the deadline.
    """
    ctx = mp.get_context("spawn")
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300)
    )
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world, store.port, process_group, args, q), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while len(results) + len(failures) < world and time.monotonic() < deadline:
        try:
            rank, ok, payload = q.get(timeout=0.5)
        except queue.Empty:
            for r, p in enumerate(procs):
                if r not in results and r not in failures and p.exitcode is not None:
                    time.sleep(0.5)  # a result put just before exit may still be in the pipe
                    if q.empty():
                        failures[r] = f"exited with code {p.exitcode} without a result"
            continue
        (results if ok else failures)[rank] = payload
    for r, p in enumerate(procs):
        p.join(timeout=max(1.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(10)
            failures.setdefault(r, f"still running after the session deadline of {timeout:.0f} s; killed")
    if failures:
        detail = "\n".join(f"--- rank {r}: {failures[r]}" for r in sorted(failures))
        raise SessionError(
            f"{getattr(fn, '__name__', fn)} on {world} rank(s) failed on rank(s) {sorted(failures)}; "
            f"raise --timeout if a rank was only slow:\n{detail}"
        )
    return [results[r] for r in range(world)]
