"""kill -9 at random instants of ``ModelCheckpoint``'s saves and rotation (``save_top_k=2``, every step,
``save_last=True``) on 2 DDP ranks through ``shardsafe.lightning``: both ranks are killed in a random order,
the second up to 0.3 s after the first (unless it ended on its own when it found its peer dead). What is left
is only checkpoints that verify, or leftovers that are no checkpoint at all; 2 new ranks resume from the
newest intact one (``shardsafe.lightning.latest_checkpoint``) at its step, then train and rotate on.

``SHARDSAFE_LIGHTNING_KILL_ROUNDS`` rounds (default 1 in the suite; docs/lightning.md gives the figures of a
larger run of this file).
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.catalog.names import TOMBSTONE

import harness

L = pytest.importorskip("lightning")
ROUNDS = int(os.environ.get("SHARDSAFE_LIGHTNING_KILL_ROUNDS", "1"))
WORLD = 2


def _train(rank: int, port: int, root: str, resume: bool, out: Any) -> None:
    """(one rank, a child process) Train with a checkpoint every step until killed; or resume from the
    newest intact checkpoint, report the step it started at, and train 3 more steps. Lightning joins the
    process group from the environment, as under torchrun."""
    os.environ.update(
        CUDA_VISIBLE_DEVICES="",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    import shardsafe.lightning as sl

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 2048), torch.nn.Linear(2048, 1))  # 0.5 MiB

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            self.log("score", float(self.global_step))  # the same on every rank
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-3)  # 1.5 MiB of state with the weights

    class Start(Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            out.put((rank, "start", trainer.global_step))

    data = DataLoader(TensorDataset(torch.randn(128, 64)), batch_size=4)
    mc = ModelCheckpoint(root, "{step}", monitor="score", mode="max", save_top_k=2, every_n_train_steps=1)
    mc.save_last = True
    ckpt = sl.latest_checkpoint(root) if resume else None
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=sl.DDPStrategy(checkpoint_timeout=60),
        max_steps=(shardsafe.inspect(ckpt).metadata["step"] + 3) if ckpt else 10_000,
        callbacks=[mc, Start()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Net(), data, ckpt_path=ckpt)
    out.put((rank, "done", trainer.global_step))


def _committed(root: Path) -> dict[str, int]:
    """name -> step of every checkpoint folder there, each verified; links and leftovers (a hidden pending
    directory, whose staged MANIFEST.json never committed; a folder without a manifest) left out."""
    found = {}
    for name in sorted(os.listdir(root)):
        path = root / name
        if name.startswith(".") or path.is_symlink() or not (path / "MANIFEST.json").exists():
            continue
        shardsafe.verify(path)  # raises if anything of it is damaged or missing
        found[name] = shardsafe.inspect(path).metadata["step"]
    return found


def _start(root: Path, resume: bool) -> tuple[list[Any], Any]:
    ctx = harness._CTX
    q = ctx.Queue()
    port = harness.free_port()
    ranks = [ctx.Process(target=_train, args=(r, port, str(root), resume, q), daemon=True) for r in range(WORLD)]
    for p in ranks:
        p.start()
    return ranks, q


def one_round(root: Path, rng: random.Random) -> dict[str, Any]:
    """Train on 2 ranks, kill -9 both while they save, check what is left, resume on 2 ranks."""
    ranks, _ = _start(root, False)
    deadline = time.monotonic() + 120
    while not (root / "last.ckpt" / "MANIFEST.json").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(rng.uniform(0.0, 2.0))
    first = rng.randrange(WORLD)
    os.kill(ranks[first].pid, signal.SIGKILL)  # type: ignore[arg-type]
    time.sleep(rng.uniform(0.0, 0.3))
    try:
        os.kill(ranks[1 - first].pid, signal.SIGKILL)  # type: ignore[arg-type]
        survivor_quit = False
    except ProcessLookupError:  # it found its peer dead (or its store gone) and ended on its own
        survivor_quit = True
    for p in ranks:
        p.join(30)
        assert p.exitcode not in (0, None), p.exitcode  # killed, or ended by the error of its peer's death
    left = sorted(os.listdir(root))
    committed = _committed(root)
    assert committed, left
    newest = max(committed.values())
    ranks, q = _start(root, True)
    got: dict[tuple[int, str], int] = {}
    deadline = time.monotonic() + 180
    while len(got) < 2 * WORLD and time.monotonic() < deadline:
        try:
            rank, kind, step = q.get(timeout=0.5)
        except Exception:
            continue
        got[(rank, kind)] = step
    for p in ranks:
        p.join(60)
        assert p.exitcode == 0, (p.exitcode, got)
    for r in range(WORLD):
        assert got[(r, "start")] == newest and got[(r, "done")] == newest + 3, (got, committed)
    after = _committed(root)  # Lightning's rotation never removes the checkpoint a run resumed from
    rotated = [n for n, step in after.items() if n != "last.ckpt" and step > newest]
    assert max(after.values()) == newest + 3 and len(rotated) == 2, after
    return {
        "committed": committed,
        "tombstoned": [n for n in left if (root / n / TOMBSTONE).exists()],
        "pending": [n for n in left if n.startswith(".")],
        "last_behind": committed.get("last.ckpt", -1) < newest,
        "survivor_quit": survivor_quit,
        "resumed_at": newest,
    }


@pytest.mark.timeout(120 + 120 * ROUNDS)
def test_kill_during_model_checkpoint_saves_leaves_only_verifiable_checkpoints(tmp_path: Path) -> None:
    rng = random.Random(int(os.environ.get("SHARDSAFE_LIGHTNING_KILL_SEED", "7")))
    seen = [one_round(tmp_path / f"r{i}", rng) for i in range(ROUNDS)]
    print(
        f"{ROUNDS} rounds: interrupted deletions {sum(bool(s['tombstoned']) for s in seen)}, interrupted saves "
        f"{sum(bool(s['pending']) for s in seen)}, last.ckpt older than the newest checkpoint "
        f"{sum(s['last_behind'] for s in seen)}, a rank that ended on its own before its kill "
        f"{sum(s['survivor_quit'] for s in seen)}"
    )
