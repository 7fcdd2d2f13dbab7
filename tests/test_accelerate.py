"""shardsafe.accelerate.Accelerator end to end on CPU ranks: a resume that continues bit for bit (random
generators, data order, position in the epoch, optimizer, scheduler) through automatic naming, total_limit
and load_state() without a folder; hooks' files committed as side files; save_state on the main process
only raising RankTimeoutError and committing nothing; an FSDP2 checkpoint of 2 ranks loaded as DDP on 1 and
3; kill -9 at random instants of save_state (SHARDSAFE_TEST_KILL_ROUNDS rounds, default 1)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate", reason="accelerate is needed (requirements-dev.txt)")

import shardsafe

from harness import check_ok, run_ranks

HERE = Path(__file__).resolve().parent
EPOCH_BATCHES = 4  # per rank: 32 samples, batch 4, 2 ranks


class Progress:
    """Where the loop is (epoch, batch within it) and what it drew: registered for checkpointing."""

    def __init__(self) -> None:
        self.epoch = 0
        self.batch = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])


def _setup(root: str, seed: int, total_limit: int | None = 2, fsdp2: bool = False, timeout: float = 60) -> Any:
    from accelerate.utils import DataLoaderConfiguration, FullyShardedDataParallelPlugin, ProjectConfiguration, set_seed

    from shardsafe.accelerate import Accelerator

    config = ProjectConfiguration(project_dir=root, automatic_checkpoint_naming=True, total_limit=total_limit)
    acc = Accelerator(
        cpu=True,
        project_config=config,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        checkpoint_timeout=timeout,
    )
    if fsdp2:  # Accelerate turns FSDP on for accelerators only; on CPU ranks the test sets it as a GPU node has it
        from accelerate.utils import DistributedType

        acc.state.distributed_type = DistributedType.FSDP
        acc.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2, cpu_ram_efficient_loading=False)
    set_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    g = torch.Generator().manual_seed(7)  # the same data whatever the seed
    data = torch.utils.data.TensorDataset(torch.randn(32, 6, generator=g), torch.randn(32, 2, generator=g))
    # A generator of its own: starting an iterator draws a seed from it (for workers), not from torch's global
    # generator, whose draws (the dropout masks) a resumed run must see unchanged.
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
    progress = Progress()
    acc.register_for_checkpointing(progress)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    return acc, model, opt, loader, sched, progress


def _train(parts: Any, until: int, save_at: tuple[int, ...] = ()) -> list[float]:
    """Train until ``until`` steps in all (from where ``progress`` says), saving after the steps in
    ``save_at``; the losses and this rank's draws of Python's and NumPy's generators, step by step."""
    import numpy as np

    acc, model, opt, loader, sched, progress = parts
    out: list[float] = []
    while progress.epoch * EPOCH_BATCHES + progress.batch < until:
        source = acc.skip_first_batches(loader, progress.batch) if progress.batch else loader
        source.set_epoch(progress.epoch)
        for x, y in source:
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            progress.batch += 1
            out += [loss.item(), random.random(), float(np.random.rand())]
            if progress.batch == EPOCH_BATCHES:
                progress.epoch, progress.batch = progress.epoch + 1, 0
            step = progress.epoch * EPOCH_BATCHES + progress.batch
            if step in save_at:
                acc.save_state()
            if step >= until:
                break
    return out


def _resume_bitwise(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    hooked = _setup(root, seed=0)
    acc = hooked[0]

    def hook(models: list[Any], weights: list[Any], folder: str) -> None:
        with open(os.path.join(folder, "data.json"), "w") as f:
            json.dump({"class_name": type(models[0]).__name__}, f)

    acc.register_save_state_pre_hook(hook)
    # saves after steps 2, 6 (mid-epoch) and 9: total_limit=2 keeps checkpoint_1 (step 6) and checkpoint_2
    first = _train(hooked, 10, save_at=(2, 6, 9))
    out["after6"] = first[6 * 3 :]  # from step 7 on
    out["final"] = [p.detach().clone() for p in hooked[1].parameters()]
    out["listing"] = sorted(os.listdir(os.path.join(root, "checkpoints")))
    out["side"] = shardsafe.read_file(os.path.join(root, "checkpoints", "checkpoint_2"), "data.json")
    # A fresh start from other seeds, resumed from checkpoint_1 (step 6): newest intact after the damage below.
    torch.distributed.barrier()  # (test only) every rank's checkpoint_2 is written before it is damaged
    if rank == 0:
        newest = os.path.join(root, "checkpoints", "checkpoint_2")
        victim = next(n for n in sorted(os.listdir(newest)) if n.startswith("data-"))
        with open(os.path.join(newest, victim), "r+b") as f:
            f.seek(-1, os.SEEK_END)
            byte = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0xFF]))
    torch.distributed.barrier()
    again = _setup(root, seed=123)
    loads: list[str] = []
    again[0].register_load_state_pre_hook(lambda models, folder: loads.append(Path(folder, "data.json").read_text()))
    again[0].load_state()
    out["loaded_hook"] = loads
    out["resumed_at"] = (again[5].epoch, again[5].batch)
    out["again"] = _train(again, 10)
    out["final_again"] = [p.detach().clone() for p in again[1].parameters()]
    # save_state on the main process only: RankTimeoutError within the deadline, nothing committed.
    alone = _setup(f"{root}/alone", seed=0, timeout=3)
    begun = time.monotonic()
    if alone[0].is_main_process:
        try:
            alone[0].save_state()
            out["alone"] = "returned"
        except shardsafe.RankTimeoutError as err:
            out["alone"] = f"RankTimeoutError {err.missing_ranks}"
        out["alone_seconds"] = time.monotonic() - begun
    else:
        time.sleep(6)  # training on, never calling save_state
    return out


def test_resume_is_bitwise_and_rotation_hooks_and_the_main_process_alone(tmp_path: Path) -> None:
    r0, r1 = check_ok(run_ranks(_resume_bitwise, 2, str(tmp_path), timeout=240))
    for r in (r0, r1):
        assert r["listing"] == ["checkpoint_1", "checkpoint_2"]  # total_limit=2, applied after each commit
        assert json.loads(r["side"]) == {"class_name": "Sequential"} and r["side"] == r0["side"]
        assert r["resumed_at"] == (1, 2)  # checkpoint_2 damaged: skipped (WARNING), checkpoint_1 is step 6
        assert r["loaded_hook"] == [r["side"].decode()] * 2  # called for checkpoint_2, then for checkpoint_1
        assert r["again"] == r["after6"]  # losses, Python's and NumPy's draws: the same, step by step
        assert all(torch.equal(a, b) for a, b in zip(r["final"], r["final_again"], strict=True))
    assert r0["after6"] != r1["after6"]  # each rank's own generators and data
    assert r0["alone"] == "RankTimeoutError [1]" and r0["alone_seconds"] < 3 + 10
    assert not (tmp_path / "alone" / "checkpoints" / "checkpoint_0").exists()
    assert [n for n in os.listdir(tmp_path / "alone" / "checkpoints") if not n.startswith(".")] == []
    assert [n for n in os.listdir(tmp_path / "alone" / "checkpoints")] == []  # its pending directory is gone too


def _hook_links_its_folder(rank: int, world: int, root: str) -> dict[str, Any]:
    """A save-state hook that replaces its folder with a symbolic link to a folder of the user's."""
    acc = _setup(root, seed=0)[0]
    victim = os.path.join(root, "mine")
    os.makedirs(victim)
    Path(victim, "data.json").write_text("the user's")

    links: list[str] = []

    def hook(models: list[Any], weights: list[Any], folder: str) -> None:
        os.rmdir(folder)
        os.symlink(victim, folder)
        links.append(folder)

    acc.register_save_state_pre_hook(hook)
    try:
        acc.save_state(os.path.join(root, "ckpt"))
        error = None
    except shardsafe.CheckpointError as err:
        error = type(err).__name__
    left = [os.path.islink(p) for p in links]
    for p in links:
        os.unlink(p)  # the test's own link, left (with a WARNING) by save_state
    committed = os.path.exists(os.path.join(root, "ckpt", "MANIFEST.json"))
    return {"error": error, "victim": sorted(os.listdir(victim)), "committed": committed, "left": left}


def test_a_hook_folder_replaced_by_a_link_is_refused_and_nothing_is_moved_nor_deleted_through_it(
    tmp_path: Path,
) -> None:
    """Before, the main process moved what the link's folder held into the checkpoint (os.replace through
    the link: the user's file left its folder) and then unlinked the files through it."""
    (r,) = check_ok(run_ranks(_hook_links_its_folder, 1, str(tmp_path), timeout=120))
    assert r["victim"] == ["data.json"] and (tmp_path / "mine" / "data.json").read_text() == "the user's"
    assert r["error"] == "InvalidArgumentError" and not r["committed"]
    assert r["left"] == [True]  # the link itself stays (never removed as if it were the folder)


def _fsdp2_save(rank: int, world: int, root: str) -> dict[str, Any]:
    parts = _setup(root, seed=0, fsdp2=True)
    _train(parts, 3, save_at=(3,))
    model, opt = parts[1], parts[2]
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    avg = {n: opt.state[p]["exp_avg"].full_tensor() for n, p in model.named_parameters()}
    return {"params": full, "exp_avg": avg, "kind": type(next(model.parameters())).__name__}


def _ddp_load(rank: int, world: int, root: str) -> dict[str, Any]:
    parts = _setup(root, seed=5)
    parts[0].load_state(os.path.join(root, "checkpoints", "checkpoint_0"))
    model, opt = parts[1], parts[2]
    inner = getattr(model, "module", model)
    return {
        "params": {n: p.detach().clone() for n, p in inner.named_parameters()},
        "exp_avg": {n: opt.state[p]["exp_avg"].clone() for n, p in inner.named_parameters()},
        "progress": (parts[5].epoch, parts[5].batch),
        "lr": parts[4].get_last_lr(),
    }


def test_fsdp2_on_two_ranks_resumes_as_ddp_on_one_and_three(tmp_path: Path) -> None:
    saved = check_ok(run_ranks(_fsdp2_save, 2, str(tmp_path), timeout=180))[0]
    assert saved["kind"] == "DTensor"
    for world in (1, 3):
        for got in check_ok(run_ranks(_ddp_load, world, str(tmp_path), timeout=180)):
            for what in ("params", "exp_avg"):
                assert set(got[what]) == set(saved[what])
                assert all(torch.equal(got[what][n], saved[what][n]) for n in saved[what]), (world, what)
            assert got["progress"] == (0, 3)
            assert got["lr"] == [1e-2 * 0.5**3]  # Accelerate steps the scheduler once per rank: 6 StepLR steps


def _committed(root: Path) -> list[Path]:
    folder = root / "checkpoints"
    found = [p for p in folder.iterdir() if (p / "MANIFEST.json").exists()] if folder.exists() else []
    return sorted(found, key=lambda p: int(p.name.rsplit("_", 1)[1]))


def test_kill_at_random_instants_of_save_state_leaves_two_verifiable_and_resumes_the_newest(tmp_path: Path) -> None:
    rounds = int(os.environ.get("SHARDSAFE_TEST_KILL_ROUNDS", "1"))
    rng = random.Random(int(os.environ.get("SHARDSAFE_TEST_KILL_SEED", "0")))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    expected: int | None = None
    for n in range(rounds + 1):
        child = subprocess.Popen(
            [sys.executable, str(HERE / "hf_kill_child.py"), str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            text=True,
        )
        assert child.stdout is not None
        saved = 0
        try:
            line = child.stdout.readline()
            if expected is not None:  # the newest committed checkpoint is what load_state() resumed
                assert line.split() == ["resumed", str(expected)], f"round {n}: {line!r}"
                line = child.stdout.readline()
            while line.startswith("saved") and saved < (3 if n == 0 else 1):
                saved += 1
                line = child.stdout.readline()
            assert line.startswith("saved"), f"round {n}: {line!r}"
            if n == rounds:
                break
            time.sleep(rng.uniform(0.0, 0.25))  # somewhere inside a save_state (each takes about that long)
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(30)
        committed = _committed(tmp_path)
        assert 2 <= len(committed) <= 3, [p.name for p in committed]  # 3: killed between a commit and rotation
        for path in committed:
            shardsafe.verify(path)
        expected = int(shardsafe.load(committed[-1])["custom_0"]["step"])
    assert len(_committed(tmp_path)) == 2
