"""Starting worker processes and watching them: the parent side of :meth:`shardsafe.runtime.Runtime.launch`.

The parent hosts the rendezvous store (a ``TCPStore`` bound to a port the OS picks, kept open for the
whole run, so no other program can take the port between choosing and using it) and starts one worker
per rank with the *spawn* start method. Workers import the main module as ``__mp_main__`` (code under
``if __name__ == "__main__":`` does not run again) and call ``fn(runtime, *args, **kwargs)``.

The parent waits for each worker's report over its own pipe. The first failure (an exception, or a
worker that died without reporting) stops the other workers (SIGTERM, then SIGKILL after a grace
period) and is raised in the parent: the worker's own exception when it can be rebuilt, with the
worker's traceback attached as ``__cause__``.
"""

from __future__ import annotations

import ast
import logging
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

import torch

from shardsafe.errors import CheckpointTimeoutError
from shardsafe.runtime.config import Plan, RuntimeConfig
from shardsafe.runtime.errors import LaunchError, WorkerError, WorkerTraceback

if TYPE_CHECKING:  # torch.distributed re-exports these without declaring them for type checkers
    from torch._C._distributed_c10d import TCPStore
else:
    from torch.distributed import TCPStore

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
STOP_GRACE_SECONDS = 5.0
"""After a failure, how long the other workers get to exit on SIGTERM before SIGKILL."""
EXIT_GRACE_SECONDS = 60.0
"""After a worker reported success, how long it may take to exit (tear down its process group)."""
FAILURE_WINDOW_SECONDS = 1.0
"""After the first failure, how long to collect others, to report the root cause rather than an echo."""


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs, pickled to it at start."""

    config: RuntimeConfig
    plan: Plan
    rank: int
    port: int
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    launched_at: str


@dataclass
class _Failure:
    rank: int
    when: float
    died: bool
    error: BaseException


def bootstrapping() -> bool:
    """True while a spawned child is still importing the parent's main module (before it runs its target)."""
    return bool(getattr(mp.current_process(), "_inheriting", False))


def unguarded_main_line() -> tuple[str, int] | None:
    """``(file, line)`` when this call comes from main-module code outside ``if __name__ == "__main__":``.

    Spawned workers import the main module again; code that is not under that guard would run in every
    worker and call ``launch()`` again there. Returns ``None`` when the call is guarded or cannot be told.
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not isinstance(path, str):
        return None
    frame = sys._getframe(1)
    while frame is not None:
        if (
            frame.f_code.co_name == "<module>"
            and frame.f_globals is vars(main)
            and os.path.abspath(frame.f_code.co_filename) == os.path.abspath(path)
        ):
            break
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return None  # no main-module frame below us (e.g. called from an interpreter hook)
    line = frame.f_lineno
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.If)
            and _is_main_test(node.test)
            and node.lineno <= line <= (node.end_lineno or node.lineno)
        ):
            return None
    return path, line


def _is_main_test(test: ast.expr) -> bool:
    names = {n.id for n in ast.walk(test) if isinstance(n, ast.Name)}
    consts = {n.value for n in ast.walk(test) if isinstance(n, ast.Constant)}
    return "__name__" in names and "__main__" in consts


def run_workers(
    config: RuntimeConfig,
    plan: Plan,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    launched_at: str,
    start_timeout: float,
    finish_timeout: float,
) -> Any:
    """(parent) Run ``fn`` on ``plan.world_size`` spawned workers; return rank 0's result, or raise the
    first failure after stopping the others. Waits up to ``start_timeout`` for each worker to start
    running (importing the main module included), then as long as ``fn`` runs, and once a rank has
    returned, up to ``finish_timeout`` for the others to return too."""
    world = plan.world_size
    ctx = mp.get_context("spawn")
    store = TCPStore(HOST, 0, world, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=start_timeout))
    procs: list[Any] = []
    conns: list[Connection] = []
    ok = False
    try:
        for rank in range(world):
            spec = WorkerSpec(config, plan, rank, store.port, fn, args, kwargs, launched_at)
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=worker_main, args=(spec, send), name=f"shardsafe-rank{rank}")
            try:
                proc.start()
            except (pickle.PicklingError, AttributeError, TypeError) as err:
                raise LaunchError(
                    f"launch(): the function {getattr(fn, '__qualname__', fn)!r} or its arguments cannot be "
                    f"sent to the worker processes ({err}). Define the function at module top level (no "
                    "lambda or nested function) and pass picklable arguments"
                ) from err
            send.close()  # the worker holds the write end now; EOF on recv means it is gone
            procs.append(proc)
            conns.append(recv)
        result = _supervise(procs, conns, start_timeout, finish_timeout)
        ok = True
        return result
    finally:
        _stop(procs, grace=EXIT_GRACE_SECONDS if ok else STOP_GRACE_SECONDS, polite=ok)
        for conn in conns:
            conn.close()
        del store  # the port is released only now, after every worker is gone


def _supervise(procs: list[Any], conns: list[Connection], start_timeout: float, finish_timeout: float) -> Any:
    world = len(procs)
    started: set[int] = set()
    finished: set[int] = set()
    failures: list[_Failure] = []
    result: Any = None
    start_deadline = time.monotonic() + start_timeout
    first_failure_at: float | None = None
    first_return_at: float | None = None
    open_conns = dict(enumerate(conns))
    while len(finished) < world:
        now = time.monotonic()
        if first_failure_at is not None and now - first_failure_at >= FAILURE_WINDOW_SECONDS:
            break
        if len(started) < world and now > start_deadline:
            late = sorted(set(range(world)) - started)
            raise CheckpointTimeoutError(
                f"worker rank(s) {late} did not start within {start_timeout:.0f}s (spawning a process and "
                "importing the main module). Is the machine overloaded, or does importing the script block? "
                "Raise timeout= (or SHARDSAFE_TIMEOUT) if starting is merely slow."
            )
        if first_return_at is not None and now - first_return_at > finish_timeout:
            late = sorted(set(range(world)) - finished)
            raise CheckpointTimeoutError(
                f"worker rank(s) {late} were still running {finish_timeout:.0f}s after another rank had returned "
                "from the launched function; they were stopped. Every rank must make the same collective calls "
                "(look for a rank-dependent loop or branch), or raise timeout= if they are merely slower."
            )
        waitables: list[Any] = list(open_conns.values())
        waitables += [p.sentinel for r, p in enumerate(procs) if r not in finished]
        ready = wait(waitables, timeout=0.5)
        for rank, conn in list(open_conns.items()):
            if conn not in ready:
                continue
            try:
                msg = pickle.loads(conn.recv_bytes())
            except EOFError:
                del open_conns[rank]  # closed: the worker exited; its sentinel tells how
                continue
            kind = msg[0]
            if kind == "started":
                started.add(rank)
            elif kind == "ok":
                finished.add(rank)
                first_return_at = first_return_at or time.monotonic()
                if rank == 0:
                    result = msg[1]
            else:
                failures.append(_remote_failure(rank, world, msg))
                finished.add(rank)
        for rank, proc in enumerate(procs):
            if rank in finished or proc.sentinel not in ready or (rank in open_conns and open_conns[rank].poll()):
                continue  # a report still waiting in the pipe is read on the next round
            proc.join(1.0)
            finished.add(rank)
            failures.append(_death(rank, proc.exitcode, started=rank in started))
        if failures and first_failure_at is None:
            first_failure_at = time.monotonic()
    if failures:
        _raise_root_cause(failures)
    return result


def _remote_failure(rank: int, world: int, msg: tuple[Any, ...]) -> _Failure:
    _, blob, type_name, text, tb, when, pid = msg
    err: BaseException
    try:
        if blob is None:
            raise TypeError("the worker could not pickle it")
        loaded = pickle.loads(blob)
        if not isinstance(loaded, BaseException):
            raise TypeError(f"unpickled {type(loaded).__name__}, not an exception")
        err = loaded
    except Exception as unpickle_error:  # the worker's class may need arguments pickle does not carry
        err = WorkerError(
            f"rank {rank} raised {type_name}: {text} (its exception could not be rebuilt in the launching "
            f"process: {unpickle_error}; the worker's traceback is attached)",
            rank=rank,
            exitcode=None,
            remote_traceback=tb,
        )
    err.__cause__ = WorkerTraceback(rank, tb)
    _note(err, f"raised on rank {rank} of {world} (worker pid {pid}); the other workers were stopped")
    return _Failure(rank=rank, when=when, died=False, error=err)


def _death(rank: int, exitcode: int | None, *, started: bool) -> _Failure:
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = str(-exitcode)
        how = f"was killed by signal {name}"
    else:
        how = f"exited with code {exitcode}"
    if started:
        text = (
            f"worker rank {rank} {how} without reporting a result or an exception (os._exit, a signal, or "
            "a crash in native code); the other workers were stopped"
        )
    else:
        text = (
            f"worker rank {rank} {how} before it started running (while unpickling its function or "
            "importing the main module; its error output is above). Functions passed to launch() must be "
            "importable: defined at module top level, and the call to launch() guarded by "
            "`if __name__ == '__main__':`"
        )
    return _Failure(rank=rank, when=time.time(), died=True, error=WorkerError(text, rank=rank, exitcode=exitcode))


def _raise_root_cause(failures: list[_Failure]) -> None:
    """Raise the failure most likely to be the cause: a death (the others then fail talking to it), else
    the earliest exception. The rest are noted on it."""
    deaths = [f for f in failures if f.died]
    first = min(deaths or failures, key=lambda f: f.when)
    others = [f for f in failures if f is not first]
    for f in sorted(others, key=lambda f: f.rank):
        _note(first.error, f"rank {f.rank} also failed: {type(f.error).__name__}: {f.error}".split("\n")[0])
    raise first.error


def _note(err: BaseException, text: str) -> None:
    """``err.add_note(text)``; on Python 3.10, which has no ``add_note``, appended to ``__notes__`` as
    PEP 678 defines it (kept for code that reads it; 3.10's traceback does not print it)."""
    if hasattr(err, "add_note"):
        err.add_note(text)
        return
    try:
        notes = getattr(err, "__notes__", None)
        err.__notes__ = [*(notes or []), text]  # type: ignore[attr-defined]
    except (AttributeError, TypeError):  # an exception type that refuses new attributes: no note
        pass


def _stop(procs: list[Any], *, grace: float, polite: bool) -> None:
    """(parent) Make sure no worker outlives the launch: wait ``grace`` seconds (after SIGTERM unless
    ``polite``), then SIGKILL."""
    alive = [p for p in procs if p.is_alive()]
    if not polite:
        for p in alive:
            p.terminate()
    deadline = time.monotonic() + grace
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.is_alive():
            logger.warning("shardsafe: worker %s did not exit within %.0fs; killing it", p.name, grace)
            p.kill()
            p.join(STOP_GRACE_SECONDS)


# ------------------------------------------------------------------------------------------ worker side


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """(each worker) Join the world through the parent's store, run ``fn``, report to the parent."""
    _send(conn, ("started", os.getpid()))
    _exit_with_parent()
    os.environ.update(
        RANK=str(spec.rank),
        LOCAL_RANK=str(spec.rank),
        WORLD_SIZE=str(spec.plan.world_size),
        LOCAL_WORLD_SIZE=str(spec.plan.devices),
        GROUP_RANK="0",
        MASTER_ADDR=HOST,
        MASTER_PORT=str(spec.port),
    )
    if spec.plan.accelerator == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # One process per core group: without this, every worker would start one thread per core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.plan.devices))
    from shardsafe.runtime.runtime import Runtime  # here, not at the top: runtime.py imports this module

    try:
        rt = Runtime._for_worker(spec.config, spec.plan, rank=spec.rank, launched_at=spec.launched_at)
        store = TCPStore(
            HOST, spec.port, spec.plan.world_size, is_master=False, timeout=timedelta(seconds=rt.deadlines.arrive)
        )
        rt._join_world(store=store, rank=spec.rank, world_size=spec.plan.world_size, local_rank=spec.rank)
        result = spec.fn(rt, *spec.args, **spec.kwargs)
        try:
            _send(conn, ("ok", result if spec.rank == 0 else None))
        except Exception as err:
            raise TypeError(
                f"launch(): rank 0's return value ({type(result).__name__}) cannot be sent to the launching "
                f"process ({err}); return something picklable, e.g. plain numbers, lists or CPU tensors"
            ) from err
        rt._leave_world()
    except BaseException as err:  # every failure goes to the parent, which stops the others and raises it
        _report(conn, err)


def _report(conn: Connection, err: BaseException) -> None:
    try:
        blob: bytes | None = pickle.dumps(err)
    except Exception:  # e.g. an exception holding a lock or a tensor hook: send its text alone
        blob = None
    text = traceback.format_exc()
    _send(conn, ("err", blob, type(err).__name__, str(err), text, time.time(), os.getpid()))


def _send(conn: Connection, msg: tuple[Any, ...]) -> None:
    # Plain pickle, by value: Connection.send would share tensors through file descriptors that
    # vanish when this worker exits before the parent reads them.
    conn.send_bytes(pickle.dumps(msg))


def _exit_with_parent() -> None:
    """A worker whose parent died (e.g. SIGKILL) exits too, instead of waiting forever in a collective."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(70)

    threading.Thread(target=watch, name="shardsafe-parent-watch", daemon=True).start()
