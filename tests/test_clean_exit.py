"""Nothing of shardsafe outlives its call, and exit is clean (DESIGN principle 20).

A job whose script ends right after a save used to lose a rank to SIGABRT at exit ("terminate called
without an active exception"), a few runs in fifteen: the watchdog thread, still ticking, made a store
request after the exit hook had closed the connections, opening a new ``TCPStore`` client on a daemon
thread that the finalizing interpreter killed inside the constructor. Now every thread of a call ends
before the call returns, and from the exit hook on nothing starts a store request or a connection.

``SHARDSAFE_EXIT_TRIALS`` sets the number of torchrun trials (default 6; run 100 or more by hand).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import torch

import shardsafe
from shardsafe.coord import Deadlines

from harness import run_ranks

HERE = Path(__file__).parent


def _threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("shardsafe"))


def _calls_then_exit(rank: int, world: int, root: str) -> dict[str, Any]:
    import shardsafe.coord.client as client_module
    from shardsafe.coord import liveness
    from shardsafe.engine import inflight

    state: dict[str, Any] = {"model": torch.nn.Linear(8, 4), "step": 1}
    seen: dict[str, list[str]] = {}
    shardsafe.save(os.path.join(root, "a"), state, timeout=60, progress=lambda _p: None)
    seen["save"] = _threads()
    shardsafe.async_save(os.path.join(root, "b"), state, timeout=60, progress=lambda _p: None).wait()
    seen["async_save().wait()"] = _threads()
    shardsafe.load(os.path.join(root, "a"), state, timeout=60, progress=lambda _p: None)
    seen["load"] = _threads()
    manager = shardsafe.CheckpointManager(os.path.join(root, "run"), every_seconds=3600)
    manager.should_save(1)
    seen["CheckpointManager.should_save"] = _threads()

    opened: list[str] = []
    connect = client_module._connect

    def counting(*args: Any) -> Any:
        opened.append(threading.current_thread().name)
        return connect(*args)

    client_module._connect = counting
    # the exit hooks, in the order the interpreter runs them ...
    inflight._flush_at_exit()
    client_module._close_all()
    # ... then what a watchdog thread still looping (or any late thread) would do: a heartbeat, and a
    # posted request
    refused = []
    for dog in list(liveness._dogs.values()):
        try:
            dog._tick()
        except shardsafe.CheckpointError as err:
            refused.append(type(err).__name__)
        try:
            dog.client.set("late", "1", Deadlines.resolve(5).start().end)
        except shardsafe.CheckpointError as err:
            refused.append(type(err).__name__)
    return {"threads": seen, "opened": opened, "refused": refused, "at exit": _threads()}


def test_no_thread_outlives_its_call_and_none_talks_to_the_store_at_exit(tmp_path: Path) -> None:
    for o in run_ranks(_calls_then_exit, 2, str(tmp_path), timeout=120):
        assert o.ok, o
        left = {call: names for call, names in o.result["threads"].items() if names}
        assert not left, f"rank {o.rank}: threads still alive after the call returned: {left}"
        assert o.result["opened"] == [], f"rank {o.rank} opened a store connection after the exit hook: {o.result}"
        assert o.result["refused"] == ["ClosedError", "ClosedError"], o.result
        assert o.result["at exit"] == [], o.result


def test_a_torchrun_job_that_ends_right_after_a_save_exits_0_on_every_rank(tmp_path: Path) -> None:
    trials = int(os.environ.get("SHARDSAFE_EXIT_TRIALS", "6"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")]))
    env.pop("SHARDSAFE_FAULT", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    run = subprocess.run(
        [*cmd, str(HERE / "exit_trials.py"), str(tmp_path), str(trials)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60 + 20 * trials,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in range(2):
        statuses = json.loads((tmp_path / f"statuses-{rank}.json").read_text())
        failed = {k: s for k, s in enumerate(statuses) if s != 0}
        assert len(statuses) == trials and not failed, (
            f"rank {rank}: trials that did not exit 0 (negative: killed by that signal; -6 is SIGABRT): {failed}\n"
            + run.stderr[-3000:]
        )
    for k in range(trials):
        shardsafe.verify(str(tmp_path / f"ckpt-{k}"))
