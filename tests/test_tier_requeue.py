"""kill -9 of the local tier across requeues whose node numbering changes (docs/tiers.md, "Runs, saves and
incarnations"): every round is a fresh 4-rank job on one durable root and the same ``local-{node}`` path,
with ranks placed on nodes 0..2 at random (``SHARDSAFE_NODE``; a node number is a folder, as it is a host's
disk in a cluster, so a requeue finds another job's entries in its folders and misses its own). Each job
resumes, then saves locally every step with values of its own (seeded by rank, step and round) until one
rank SIGKILLs itself at a random instant: after resuming (inside a save or a replication), or in a quarter
of the rounds while it resumes (inside the scan, a fetch, the load, the incarnation record, the deletes).

Asserted every round: every rank that resumed loaded exactly what one save wrote for it (its step and
round are the same on every rank, and its tensors are those that save wrote for that rank); a job whose
ranks sat on the same nodes as the job before, with no folder lost, resumes at least the last step whose
local save returned; the survivors raise; every committed entry in every folder verifies and holds what
its own save wrote for its own rank and step.

``SHARDSAFE_TEST_TIER_REQUEUE_ROUNDS`` (default 1: two jobs, a few seconds each) and ``SHARDSAFE_TEST_SEED`` choose the
run; the long run is e.g. ``SHARDSAFE_TEST_TIER_REQUEUE_ROUNDS=60``."""

from __future__ import annotations

import glob
import os
import random
import shutil
import signal
import threading
from pathlib import Path
from typing import Any

import torch

import shardsafe

from harness import run_ranks

ROUNDS = int(os.environ.get("SHARDSAFE_TEST_TIER_REQUEUE_ROUNDS", "1"))
T = 3.0
WORLD = 4


def _values(rank: int, step: int, round_: int) -> torch.Tensor:
    return torch.randn(64, generator=torch.Generator().manual_seed(1_000_003 * round_ + 1000 * step + rank))


def _state(rank: int, step: int, round_: int) -> dict[str, Any]:
    return {"mine": _values(rank, step, round_), "extra": {"step": step, "round": round_}}


def _job(rank: int, world: int, root: str, local: str, round_: int, victim: int, delay: float, early: bool) -> None:
    """Resume, write ``<resumed step> <saved step> <saved round> <exact>`` to this rank's file, then save
    locally every step until a rank fails. Rank ``victim`` SIGKILLs itself ``delay`` seconds after
    resuming, or after starting to resume when ``early``. Rank 0 appends each step whose save returned."""
    tier = shardsafe.LocalTier(local, every_n_steps=1, replicas=1, keep=2)
    kill = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)) if rank == victim else None
    if kill is not None and early:
        kill.start()
    state: dict[str, Any] = {"mine": torch.zeros(64), "extra": {"step": -1, "round": -1}}
    with shardsafe.CheckpointManager(root, every_n_steps=10**9, local=tier, timeout=30) as first:
        step = first.resume(state) or 0
    extra = state["extra"]
    exact = step == 0 or bool(torch.equal(state["mine"], _values(rank, extra["step"], extra["round"])))
    with open(f"{root}.resumed.{round_}.{rank}", "w") as f:
        f.write(f"{step} {extra['step']} {extra['round']} {int(exact)}\n")
    mgr = shardsafe.CheckpointManager(root, every_n_steps=10**9, local=tier, timeout=T)
    progress = open(f"{root}.progress.{round_}", "a")  # noqa: SIM115 - closed by the kill
    if kill is not None and not early:
        kill.start()
    while True:
        step += 1
        mgr.save_local(step, _state(rank, step, round_))
        if rank == 0:
            progress.write(f"{step}\n")
            progress.flush()


def _check_entries(tmp: Path) -> int:
    """Every committed entry verifies and holds what its save wrote for its rank and step."""
    n = 0
    for manifest in glob.glob(str(tmp / "local-*" / "run-*" / "step-*" / "*" / "MANIFEST.json")):
        entry = os.path.dirname(manifest)
        name = os.path.basename(entry)
        assert not name.startswith("."), f"a transfer or pending folder holds a committed manifest: {entry}"
        step = int(os.path.basename(os.path.dirname(entry)).split("-")[1])
        rank = int(name.rsplit("-", 1)[1])
        shardsafe.verify(entry)
        meta = shardsafe.inspect(entry).metadata
        assert meta["step"] == step and meta["rank"] == rank, (entry, meta)
        got = shardsafe.load(entry)
        assert got["extra"]["step"] == step, (entry, got["extra"])
        assert torch.equal(got["mine"], _values(rank, step, got["extra"]["round"])), entry
        n += 1
    return n


def _last(path: str) -> int:
    try:
        lines = Path(path).read_text().split()
    except FileNotFoundError:
        return 0
    return int(lines[-1]) if lines else 0


def test_kill_across_requeues_with_changed_node_numbers_resumes_one_save_on_every_rank(tmp_path: Path) -> None:
    seed = int(os.environ.get("SHARDSAFE_TEST_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    root, local = str(tmp_path / "durable"), str(tmp_path / "local-{node}")
    before: list[str] | None = None
    lost = False
    stats = {"rounds": 0, "resumed local": 0, "from scratch": 0, "early kills": 0, "entries checked": 0}
    for n in range(1, ROUNDS + 2):  # the first job starts from nothing
        nodes = [str(rng.randrange(3)) for _ in range(WORLD)]
        victim, early = rng.randrange(WORLD), rng.random() < 0.25
        delay = rng.uniform(0.0, 0.8) if early else rng.uniform(0.05, 1.0)
        env = {r: {"SHARDSAFE_NODE": nodes[r]} for r in range(WORLD)}
        outcomes = run_ranks(_job, WORLD, root, local, n, victim, delay, early, rank_env=env, timeout=T + 60)
        why = "; ".join(f"rank {o.rank}: {o.error_type}: {(o.error or '')[:1500]}" for o in outcomes)
        where = f"round {n} (seed {seed}, nodes {nodes}, victim {victim}, early {early})"
        assert outcomes[victim].exitcode == -signal.SIGKILL, f"{where}: {why}"
        for o in outcomes:
            assert o.rank == victim or (o.error_type is not None and not o.killed), f"{where}: rank {o.rank}: {why}"
        lines = {}
        for r in range(WORLD):
            p = Path(f"{root}.resumed.{n}.{r}")
            if p.exists():
                lines[r] = p.read_text().split()
        if not early:
            assert len(lines) == WORLD, f"{where}: ranks {sorted(set(range(WORLD)) - set(lines))} did not resume: {why}"
        resumed = {tuple(v[:3]) for v in lines.values()}
        assert len(resumed) <= 1, f"{where}: the ranks resumed different saves: {lines}"
        assert all(v[3] == "1" for v in lines.values()), f"{where}: a rank's values are not its save's: {lines}"
        last = _last(f"{root}.progress.{n - 1}")
        if resumed:
            step = int(next(iter(resumed))[0])
            if before == nodes and not lost:
                assert step >= last, f"{where}: resumed step {step}, older than step {last} of the same nodes"
            stats["resumed local" if step else "from scratch"] += 1
        stats["rounds"] += 1
        stats["early kills"] += early
        stats["entries checked"] += _check_entries(tmp_path)
        before, lost = nodes, False
        if rng.random() < 0.2:  # the dead rank's node is lost with it
            shutil.rmtree(tmp_path / f"local-{nodes[victim]}", ignore_errors=True)
            lost = True
    print(f"\ntier requeue rounds (seed {seed}): {stats}")
