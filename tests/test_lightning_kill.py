"""kill -9 at random instants of ``ModelCheckpoint``'s saves and rotation (``save_top_k=2``, every step,
``save_last=True``) through ``shardsafe.lightning``: what is left is only checkpoints that verify (or
leftovers that are no checkpoint at all), and a new process resumes from the newest intact one
(``shardsafe.lightning.latest_checkpoint``) at its step, then trains and rotates on.

``SHARDSAFE_LIGHTNING_KILL_ROUNDS`` rounds (default 2 in the suite; the figures in docs/lightning.md come from
a larger run of this file).
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
ROUNDS = int(os.environ.get("SHARDSAFE_LIGHTNING_KILL_ROUNDS", "2"))


def _train(root: str, resume: bool, out: Any) -> None:
    """(a child process) Train with a checkpoint every step until killed; or resume from the newest
    intact checkpoint, report the step it started at, and train 3 more steps."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(1)
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    import shardsafe.lightning as sl

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 2048), torch.nn.Linear(2048, 1))  # 0.5 MiB

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            self.log("score", float(self.global_step))
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-3)  # 1.5 MiB of state with the weights

    class Start(Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            out.put(("start", trainer.global_step))

    data = DataLoader(TensorDataset(torch.randn(64, 64)), batch_size=4)
    mc = ModelCheckpoint(
        root, "{step}", monitor="score", mode="max", save_top_k=2, every_n_train_steps=1, save_last=True
    )
    ckpt = sl.latest_checkpoint(root) if resume else None
    out.put(("resume_from", ckpt))
    trainer = L.Trainer(
        strategy=sl.SingleDeviceStrategy(checkpoint_timeout=60),
        max_steps=(shardsafe.inspect(ckpt).metadata["step"] + 3) if ckpt else 10_000,
        callbacks=[mc, Start()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Net(), data, ckpt_path=ckpt)
    out.put(("done", trainer.global_step))


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


def _messages(q: Any, until: str, timeout: float) -> dict[str, Any]:
    got: dict[str, Any] = {}
    deadline = time.monotonic() + timeout
    while until not in got and time.monotonic() < deadline:
        try:
            kind, value = q.get(timeout=0.5)
        except Exception:
            continue
        got[kind] = value
    return got


def one_round(root: Path, rng: random.Random) -> dict[str, Any]:
    """Train, kill -9 while it saves, check what is left, resume. Returns what was seen."""
    ctx = harness._CTX
    q = ctx.Queue()
    child = ctx.Process(target=_train, args=(str(root), False, q), daemon=True)
    child.start()
    deadline = time.monotonic() + 120
    while not (root / "last.ckpt" / "MANIFEST.json").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(rng.uniform(0.0, 2.0))
    os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
    child.join(30)
    assert child.exitcode == -signal.SIGKILL, child.exitcode
    left = sorted(os.listdir(root))
    committed = _committed(root)
    assert committed, left
    leftovers = [n for n in left if n not in committed]
    for n in leftovers:  # a pending directory, or a checkpoint whose deletion was cut: no manifest
        assert n.startswith(".") or not (root / n / "MANIFEST.json").exists() or (root / n).is_symlink(), n
    newest = max(committed.values())
    q2 = ctx.Queue()
    resume = ctx.Process(target=_train, args=(str(root), True, q2), daemon=True)
    resume.start()
    got = _messages(q2, "done", 180)
    resume.join(60)
    assert resume.exitcode == 0 and "done" in got, (resume.exitcode, got)
    assert got["start"] == newest, (got, committed)
    assert got["done"] == newest + 3
    after = _committed(root)  # Lightning's rotation never removes the checkpoint a run resumed from
    rotated = [n for n, step in after.items() if n != "last.ckpt" and step > newest]
    assert max(after.values()) == newest + 3 and len(rotated) == 2, after
    return {
        "killed_after": left,
        "committed": committed,
        "tombstoned": [n for n in left if (root / n / TOMBSTONE).exists()],
        "pending": [n for n in left if n.startswith(".")],
        "resumed_at": newest,
    }


@pytest.mark.timeout(120 + 90 * ROUNDS)
def test_kill_during_model_checkpoint_saves_leaves_only_verifiable_checkpoints(tmp_path: Path) -> None:
    rng = random.Random(int(os.environ.get("SHARDSAFE_LIGHTNING_KILL_SEED", "7")))
    seen = [one_round(tmp_path / f"r{i}", rng) for i in range(ROUNDS)]
    print(
        f"{ROUNDS} rounds: interrupted deletions {sum(bool(s['tombstoned']) for s in seen)}, "
        f"interrupted saves {sum(bool(s['pending']) for s in seen)}"
    )
