"""Crash consistency under kill -9 at random instants.

Two ranks save again and again, alternating between two targets and overwriting them; the parent
SIGKILLs a random rank at a random instant, so the kills land in every phase of the protocol (arrival,
writing, fsync, the staged manifest, the rename, an overwrite's file moves). After every kill:

- the survivor raises a coordination error within ``timeout + 10 s`` (no hang);
- a target that holds ``MANIFEST.json`` verifies and loads, and every tensor in it holds the value of
  one and the same save (never a mix of two saves); it is at least as new as the newest save that
  returned (durability);
- a target without ``MANIFEST.json`` is never loadable (``CheckpointNotFoundError``), and a target that
  was once committed stays committed;
- new processes save to the same root at once (each round starts with a save that must succeed).

The randomness is seeded; the seed is printed (set ``SHARDSAFE_TEST_SEED`` to replay a run). The
suite runs it for ``BUDGET`` seconds per lane; a long run asks for more with
``SHARDSAFE_TEST_CRASH_SECONDS`` (per lane) and ``SHARDSAFE_TEST_CRASH_ROUNDS`` (at least this many
rounds in all), e.g. ``SHARDSAFE_TEST_CRASH_ROUNDS=200``.
"""

from __future__ import annotations

import os
import queue
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import shardsafe

import harness
from models import build

_FORKSERVER = harness._CTX  # ranks fork from the harness's preloaded server

T = 3.0  # every deadline of the saves under test; a survivor must raise within T + 10 s
FIRST_T = 30.0
"""The deadline of each round's first save, before any kill: the two ranks start (and build their FSDP
model) seconds apart on a loaded machine; the kill comes only once that save has committed."""
BUDGET = float(os.environ.get("SHARDSAFE_TEST_CRASH_SECONDS", 20.0))  # seconds of kill rounds per lane
LANES = 3  # independent roots killed concurrently (the survivors' waits overlap)
MIN_ROUNDS = -(-int(os.environ.get("SHARDSAFE_TEST_CRASH_ROUNDS", 3 * LANES)) // LANES)  # per lane
TARGETS = ("a", "b")


def _fill(model: torch.nn.Module, value: float) -> None:
    """Every parameter (a DTensor's local shard included) holds ``value``: a save is recognisable."""
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.fill_(value)


def _save_forever(rank: int, world: int, root: str, first: int, strategy: str) -> None:
    """(every rank) Save step after step, alternating targets, overwriting, until killed or failed.
    Rank 0 appends ``<target> <step>`` to the progress file once a save has returned."""
    model, _ = build(strategy)
    blob = torch.zeros(512, 1024)  # 2 MiB, so that writing takes a moment too
    progress = open(f"{root}.progress", "a")  # noqa: SIM115 - closed by the kill
    step = first
    while True:
        target = TARGETS[step % 2]
        _fill(model, float(step))
        blob.fill_(float(step))
        deadline = FIRST_T if step == first else T
        state = {"model": model, "blob": blob, "step": step}
        shardsafe.save(f"{root}/{target}", state, overwrite=True, timeout=deadline)
        if rank == 0:
            progress.write(f"{target} {step}\n")
            progress.flush()
        step += 1


@dataclass
class Round:
    """What one kill round did and saw (for the assertion messages)."""

    lane: int
    first: int
    strategy: str
    victim: int = -1
    delay: float = 0.0
    survivor: str = ""
    problems: list[str] = field(default_factory=list)


def _logged(root: Path) -> dict[str, int]:
    """Newest step per target whose save returned (complete lines only: a kill may cut the last one)."""
    newest: dict[str, int] = {}
    path = Path(f"{root}.progress")
    if not path.exists():
        return newest
    for line in path.read_text().splitlines(keepends=True):
        if line.endswith("\n") and len(line.split()) == 2:
            target, step = line.split()
            newest[target] = max(newest.get(target, -1), int(step))
    return newest


def _kill_round(root: Path, lane: int, first: int, rng: random.Random, ever: set[str]) -> Round:
    rnd = Round(lane=lane, first=first, strategy=rng.choice(["ddp", "fsdp"]))
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    q = _FORKSERVER.Queue()
    procs = [
        _FORKSERVER.Process(
            target=harness._entry,
            args=(_save_forever, r, 2, store.port, (str(root), first, rnd.strategy), {}, q),
            daemon=True,
        )
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        started = time.monotonic()
        while _logged(root).get(TARGETS[first % 2], -1) < first:  # this round's first save committed
            if time.monotonic() - started > 60 or not all(p.is_alive() for p in procs):
                rnd.problems.append(f"the round's first save did not complete: {_drain(q)}")
                return rnd
            time.sleep(0.01)
        rnd.delay = rng.uniform(0.0, 0.4)
        rnd.victim = rng.randrange(2)
        time.sleep(rnd.delay)
        os.kill(procs[rnd.victim].pid, signal.SIGKILL)  # type: ignore[arg-type]
        killed_at = time.monotonic()
        try:
            report = q.get(timeout=T + 10)
        except queue.Empty:
            rnd.problems.append(f"the survivor (rank {1 - rnd.victim}) did not raise within {T + 10:.0f}s")
            return rnd
        rank, kind, _, etype, emsg, _, mro, _ = report
        rnd.survivor = f"rank {rank}: {etype} after {time.monotonic() - killed_at:.1f}s"
        if rank == rnd.victim or kind != "err" or "CoordinationError" not in mro:
            rnd.problems.append(f"unexpected survivor report: rank {rank} {kind} {etype}: {emsg}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
        del store
    _check_targets(root, rnd, ever)
    return rnd


def _drain(q: Any) -> list[str]:
    out: list[str] = []
    while True:
        try:
            rank, kind, _, etype, emsg, tb, _, _ = q.get(timeout=0.5)
        except queue.Empty:
            return out
        out.append(f"rank {rank} {kind} {etype}: {emsg}\n{tb}")


def _check_targets(root: Path, rnd: Round, ever: set[str]) -> None:
    """(parent) Every target is either a whole checkpoint of one save, or not loadable at all."""
    logged = _logged(root)
    for target in TARGETS:
        path = root / target
        if not (path / "MANIFEST.json").exists():
            if target in ever:
                rnd.problems.append(f"{target}: was committed before, now has no manifest")
            try:
                shardsafe.load(str(path))
            except shardsafe.CheckpointNotFoundError:
                continue
            rnd.problems.append(f"{target}: loads without a manifest")
            continue
        ever.add(target)
        try:
            shardsafe.verify(str(path))
            whole = shardsafe.load(str(path))
        except shardsafe.CheckpointError as err:
            rnd.problems.append(f"{target}: committed but broken: {type(err).__name__}: {err}")
            continue
        step = whole["step"]
        tensors = {"blob": whole["blob"]}
        tensors.update({k: v for k, v in whole["model"].items() if not k.endswith("scale")})
        torn = [k for k, v in tensors.items() if not bool((v == float(step)).all())]
        if torn:
            rnd.problems.append(f"{target}: step {step} but {torn} hold other values (a torn checkpoint)")
        if step % 2 != TARGETS.index(target) or step < logged.get(target, -1):
            rnd.problems.append(f"{target}: holds step {step}, but step {logged.get(target)} had returned")


def _lane(tmp: Path, lane: int, seed: int) -> list[Round]:
    rng = random.Random(seed * 1000 + lane)
    root = tmp / f"lane{lane}"
    root.mkdir()
    ever: set[str] = set()
    rounds: list[Round] = []
    started = time.monotonic()
    while time.monotonic() - started < BUDGET or len(rounds) < MIN_ROUNDS:
        first = (len(rounds) + 1) * 1000 + rng.randrange(2)  # both targets get the first save of a round
        rounds.append(_kill_round(root, lane, first, rng, ever))
        if rounds[-1].problems:
            break
    return rounds


@pytest.mark.timeout(int(BUDGET) + 30 * MIN_ROUNDS + 300)  # a long run (SHARDSAFE_TEST_CRASH_ROUNDS) takes long
def test_kill_9_at_random_instants_never_leaves_a_loadable_half_checkpoint(tmp_path: Path) -> None:
    seed = int(os.environ.get("SHARDSAFE_TEST_SEED", time.time_ns() % 1_000_000))
    print(f"crash consistency seed: {seed} (replay with SHARDSAFE_TEST_SEED={seed})")
    began = time.monotonic()
    with ThreadPoolExecutor(LANES) as pool:
        lanes = list(pool.map(lambda lane: _lane(tmp_path, lane, seed), range(LANES)))
    rounds = [r for lane in lanes for r in lane]
    bad = [r for r in rounds if r.problems]
    summary = (
        f"seed {seed}: {len(rounds)} kill rounds in {time.monotonic() - began:.0f}s, "
        f"victims {[r.victim for r in rounds]}"
    )
    print(summary)
    assert not bad, f"{summary}\n" + "\n".join(map(str, bad))
    committed = sum((tmp_path / f"lane{i}" / t / "MANIFEST.json").exists() for i in range(LANES) for t in TARGETS)
    assert committed >= LANES, "every lane committed at least one checkpoint"


@pytest.mark.parametrize("missing", ["empty", "data-only"])
def test_a_directory_without_manifest_is_not_a_checkpoint(tmp_path: Path, missing: str) -> None:
    path = tmp_path / "ckpt"
    if missing == "empty":
        path.mkdir()
    else:
        shardsafe.save(str(path), {"x": torch.arange(4.0)})
        (path / "MANIFEST.json").unlink()  # what a crash before the commit leaves: data, no manifest
    for fn in (shardsafe.load, shardsafe.verify, shardsafe.inspect):
        with pytest.raises(shardsafe.CheckpointNotFoundError):
            fn(str(path))
