"""The runtime: launch and setup for each strategy, failure propagation, misuse and desync errors
(raised in time, never a hang), and joining a world that torchrun started."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from shardsafe.errors import RankDesyncError
from shardsafe.runtime import LaunchError, Runtime, WorkerError, WorkerTraceback
from shardsafe.runtime.env import detect, first_host
from shardsafe.runtime.strategies import fsdp_blocks, shard_loader

from models import needs_fsdp2_on_cpu

ROOT = Path(__file__).resolve().parents[1]
NO_HANG = 120.0  # generous bound: these must fail in seconds, never wait for a default deadline


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(6, 6) for _ in range(2)])
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        out: torch.Tensor = self.head(x)
        return out


def _batch(step: int) -> torch.Tensor:
    return torch.randn(8, 6, generator=torch.Generator().manual_seed(100 + step))


def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    return (full() if full is not None else t).detach().clone()


def _train(rt: Runtime, steps: int) -> dict[str, Any]:
    torch.manual_seed(1 + rt.rank)  # different weights per rank: setup must start every rank from rank 0's
    if rt.rank == 0:
        torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = rt.setup(model, opt)
    for step in range(steps):
        x = _batch(step)[rt.rank :: rt.world_size]  # each rank its half of the same global batch
        loss = model(x).pow(2).mean()
        rt.backward(loss)
        opt.step()
        opt.zero_grad()
    rt.barrier("trained")
    return {
        "wrapper": type(model).__name__,
        "rebound": all(a is b for a, b in zip(opt.param_groups[0]["params"], model.parameters(), strict=True)),
        "params": {n: _full(p) for n, p in model.named_parameters()},
        "mean_rank": float(rt.all_reduce(float(rt.rank), "mean")),
        "from_1": rt.broadcast({"rank": rt.rank}, src=rt.world_size - 1),
    }


def _reference(steps: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(steps):
        model(_batch(step)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("strategy", "devices", "wrapper"),
    [
        ("single", 1, "Net"),
        pytest.param("fsdp", 1, "FSDPNet", marks=needs_fsdp2_on_cpu),
        ("ddp", 2, "DistributedDataParallel"),
        pytest.param("fsdp", 2, "FSDPNet", marks=needs_fsdp2_on_cpu),
    ],
)
def test_launch_and_setup_train_like_one_process(strategy: str, devices: int, wrapper: str) -> None:
    out = Runtime(accelerator="cpu", devices=devices, strategy=strategy, timeout=60).launch(_train, 3)
    assert out["wrapper"] == wrapper
    assert out["rebound"], "the optimizer must step the wrapped model's parameters"
    assert out["mean_rank"] == pytest.approx((devices - 1) / 2)
    assert out["from_1"] == {"rank": devices - 1}
    ref = _reference(3)
    names = {n.removeprefix("module.") for n in out["params"]}
    assert names == set(ref)
    for name, value in out["params"].items():
        torch.testing.assert_close(value, ref[name.removeprefix("module.")], rtol=1e-5, atol=1e-6)
    assert not mp.active_children(), "every worker must have exited"


def _fail(rt: Runtime, how: str) -> None:
    rt.barrier("ready")
    if rt.rank == 1:
        if how == "raise":
            raise ValueError("bad batch on rank 1")
        os._exit(7)
    rt.barrier("never-complete")  # rank 0 would wait here for the full deadline


@pytest.mark.parametrize("how", ["raise", "exit"])
def test_worker_failure_reaches_the_parent_and_stops_the_others(how: str) -> None:
    started = time.monotonic()
    rt = Runtime(accelerator="cpu", devices=2, strategy="ddp", timeout=300)
    if how == "raise":
        with pytest.raises(ValueError, match="bad batch on rank 1") as info:
            rt.launch(_fail, how)
        cause = info.value.__cause__
        assert isinstance(cause, WorkerTraceback) and cause.rank == 1
        assert "test_runtime.py" in cause.text and "_fail" in cause.text
        assert any("rank 1 of 2" in note for note in getattr(info.value, "__notes__", []))
    else:
        with pytest.raises(WorkerError, match="rank 1 exited with code 7") as winfo:
            rt.launch(_fail, how)
        assert winfo.value.rank == 1 and winfo.value.exitcode == 7
    assert time.monotonic() - started < NO_HANG
    assert not mp.active_children(), "rank 0 must have been stopped"


def _desync(rt: Runtime, out: str) -> None:
    try:
        if rt.rank == 0:
            rt.setup(Net())  # DESYNC-SETUP
        else:
            rt.barrier("warm-up")  # DESYNC-BARRIER: a code path rank 0 does not take
            rt.setup(Net())
    except RankDesyncError as err:
        Path(out, f"rank{rt.rank}.txt").write_text(str(err))
        raise


def test_desync_before_setup_raises_on_every_rank_naming_both_call_sites(tmp_path: Path) -> None:
    source = Path(__file__).read_text().splitlines()
    line_setup = next(i for i, s in enumerate(source, 1) if s.endswith("# DESYNC-SETUP"))
    line_barrier = next(i for i, s in enumerate(source, 1) if "# DESYNC-BARRIER" in s)
    started = time.monotonic()
    with pytest.raises(RankDesyncError):
        Runtime(accelerator="cpu", devices=2, strategy="ddp", timeout=30).launch(_desync, str(tmp_path))
    assert time.monotonic() - started < NO_HANG
    for rank in (0, 1):
        msg = (tmp_path / f"rank{rank}.txt").read_text()
        assert f"test_runtime.py:{line_setup}" in msg and f"test_runtime.py:{line_barrier}" in msg
        assert "setup(" in msg and "barrier('warm-up')" in msg


# ------------------------------------------------------------------------------------------- misuse


def _noop(rt: Runtime) -> int:
    return rt.world_size


def _launch_again(rt: Runtime) -> None:
    rt.launch(_noop)


def test_launch_twice_and_launch_inside_the_launched_function() -> None:
    rt = Runtime(accelerator="cpu", devices=1)
    assert rt.launch(_noop) == 1
    with pytest.raises(LaunchError, match=r"already launched at .*test_runtime\.py:\d+"):
        rt.launch(_noop)
    with pytest.raises(LaunchError, match="already launched"):
        Runtime(accelerator="cpu", devices=1).launch(_launch_again)


def test_collectives_before_launch_with_several_devices() -> None:
    rt = Runtime(accelerator="cpu", devices=2, strategy="ddp")
    for call in (lambda: rt.setup(Net()), lambda: rt.barrier("x"), lambda: rt.all_reduce(1.0)):
        with pytest.raises(LaunchError, match=r"before launch\(\).*rt\.launch\(fn\)"):
            call()
    with pytest.raises(LaunchError, match="needs the function"):
        rt.launch()


def test_unpicklable_function_is_refused_before_any_worker_starts() -> None:
    with pytest.raises(LaunchError, match="cannot be sent to the worker processes"):
        Runtime(accelerator="cpu", devices=2).launch(lambda rt: rt.rank)
    assert not mp.active_children()


def test_launch_while_a_worker_imports_the_main_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mp.current_process(), "_inheriting", True, raising=False)
    with pytest.raises(LaunchError, match="still importing the main module"):
        Runtime(accelerator="cpu", devices=2).launch(_noop)


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(body))
    return path


def _run(cmd: list[str], timeout: float = NO_HANG) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in a session of its own; past ``timeout``, every process of that session is killed
    (a launcher's workers too, which would outlive it otherwise) and the test fails with their output."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{cmd} did not end within {timeout:.0f}s (its session was killed):\n{out}\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_launch_without_main_guard_fails_fast_in_the_parent(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        from shardsafe.runtime import Runtime

        def main(rt):
            return rt.rank

        rt = Runtime(accelerator="cpu", devices=2, strategy="ddp")
        print("result", rt.launch(main))
        """,
    )
    proc = _run([sys.executable, str(script)])
    assert proc.returncode != 0
    assert "LaunchError" in proc.stderr and f"{script}:8" in proc.stderr
    assert "if __name__ == '__main__':" in proc.stderr
    assert "result" not in proc.stdout


def test_world_size_mismatch_with_torchrun_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"}
    for key, value in {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(LaunchError, match=r"expects a world of 2 x 1 processes, but torchrun started 4"):
        Runtime(accelerator="cpu", devices=2)
    assert Runtime(accelerator="cpu").world_size == 4  # devices="auto" follows torchrun


def test_config_is_checked_with_the_fix_named() -> None:
    with pytest.raises(ValueError, match=r"strategy='fdsp'.*'fsdp'"):
        Runtime(strategy="fdsp")
    with pytest.raises(ValueError, match="devices=0"):
        Runtime(devices=0)
    with pytest.raises(ValueError, match="strategy='single' runs one process"):
        Runtime(accelerator="cpu", devices=2, strategy="single")
    with pytest.raises(LaunchError, match="num_nodes=2 needs an outside launcher"):
        Runtime(accelerator="cpu", num_nodes=2)
    with pytest.raises(TypeError, match="block_types"):
        Runtime(strategy="fsdp", block_types=[int])  # type: ignore[list-item]
    auto = Runtime(accelerator="cpu", devices=2)
    assert auto.strategy == "ddp" and "strategy=ddp (2 processes)" in auto.plan.summary()


def test_slurm_environment_is_joined() -> None:
    assert first_host("gpu[07-09,12],cpu1") == "gpu07"
    assert first_host("node3") == "node3"
    env = {
        "SLURM_NTASKS": "4",
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "1",
        "SLURM_NNODES": "2",
        "SLURM_NODEID": "1",
        "SLURM_NTASKS_PER_NODE": "2(x2)",
        "SLURM_JOB_NODELIST": "n[10-11]",
        "SLURM_JOB_ID": "12345",
        "SLURM_JOB_NAME": "train",
    }
    c = detect(env)
    assert c is not None and c.kind == "slurm"
    assert (c.rank, c.world_size, c.local_rank, c.local_world_size, c.num_nodes) == (3, 4, 1, 2, 2)
    assert (c.master_addr, c.master_port) == ("n10", 10000 + 12345 % 20000)
    assert detect({**env, "SLURM_JOB_NAME": "bash"}) is None  # an interactive allocation starts nothing


def test_fsdp_block_policy() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(4, 6)
            self.layers = nn.ModuleList([nn.Sequential(nn.Linear(6, 6), nn.ReLU()) for _ in range(3)])

    m = Model()
    assert fsdp_blocks(m, None) == list(reversed(m.layers))
    linears = [layer[0] for layer in m.layers]  # type: ignore[index]
    assert fsdp_blocks(m, (nn.Linear,)) == linears[::-1]
    with pytest.raises(ValueError, match="matches no submodule"):
        fsdp_blocks(m, (nn.Conv1d,))


def test_setup_dataloader_gives_each_rank_its_own_part() -> None:
    loader = DataLoader(TensorDataset(torch.arange(10)), batch_size=2, shuffle=True)
    seen = [[int(v) for (b,) in shard_loader(loader, rank=r, world_size=2, seed=3) for v in b] for r in (0, 1)]
    assert sorted(seen[0] + seen[1]) == list(range(10)) and not set(seen[0]) & set(seen[1])
    with pytest.raises(ValueError, match="IterableDataset"):
        shard_loader(DataLoader(_Stream()), rank=0, world_size=2, seed=0)


class _Stream(torch.utils.data.IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(3))


# --------------------------------------------------------------------------------------------- torchrun

_TORCHRUN_SCRIPT = """
import faulthandler, json, os, sys
import torch
from torch import nn
from shardsafe.runtime import LaunchError, Runtime

def main(rt, path):
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, opt = rt.setup(model, opt)
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    rt.barrier("stepped")
    rt.save(path, {"model": model, "optim": opt, "step": 1})
    state = {"model": model, "optim": opt, "step": 0}
    rt.load(path, state)
    total = rt.all_reduce(torch.tensor(float(rt.rank + 1)), "sum")
    return {"rank": rt.rank, "world": rt.world_size, "local_rank": rt.local_rank, "step": state["step"],
            "sum": float(total), "env_rank": int(os.environ["RANK"]), "strategy": rt.strategy}

if __name__ == "__main__":
    faulthandler.dump_traceback_later(200, exit=True)  # a hang shows where, before the test's 240 s
    try:
        Runtime(accelerator="cpu", devices=3)
    except LaunchError as err:
        mismatch = str(err)
    out = Runtime(accelerator="cpu", strategy="ddp", timeout=60).launch(main, sys.argv[1])
    out["mismatch"] = mismatch
    with open(f"{sys.argv[2]}/result-{out['rank']}.json", "w") as f:  # not stdout: ranks' lines may interleave
        json.dump(out, f)
"""


def test_torchrun_launched_world_is_joined(tmp_path: Path) -> None:
    script = _script(tmp_path, _TORCHRUN_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = _run([*cmd, str(script), str(tmp_path / "ckpt"), str(tmp_path)], timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["rank"] for r in results] == [0, 1] == [r["env_rank"] for r in results]
    for r in results:
        assert r["world"] == 2 and r["local_rank"] == r["rank"] and r["strategy"] == "ddp"
        assert r["step"] == 1 and r["sum"] == 3.0
        assert "expects a world of 3 x 1 processes, but torchrun started 2" in r["mismatch"]
    assert (tmp_path / "ckpt" / "MANIFEST.json").is_file()
