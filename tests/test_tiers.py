"""The node-local tier (docs/tiers.md): 4 CPU ranks as 2 simulated nodes (SHARDSAFE_NODE: ranks 0, 1 on
node 0; ranks 2, 3 on node 1), a local save every step, the durable store every 5.

One training run, then copies of its folders damaged in each way the issue names, each resumed by a
fresh 4-rank job: node 1's folder lost (every rank resumes the newest local step, ranks 2 and 3 from their
replicas on node 0, bit for bit); every local copy lost (the durable newest); a corrupted share with an
intact replica (the replica); a share missing everywhere (the previous complete step).

Then kill -9 of a random rank at a random instant while the ranks save and replicate, for
``SHARDSAFE_TEST_TIER_CRASH_ROUNDS`` rounds (default 1, about 6 s; 110 rounds passed once by hand:
``SHARDSAFE_TEST_TIER_CRASH_ROUNDS=110 pytest tests/test_tiers.py -k kill --timeout=2400``, 12.6 min):
every committed local entry verifies and holds the values of its own rank and step, and the next
round (a fresh job, sometimes after deleting the dead rank's whole node folder) resumes a step at
least as new as the last one whose local save returned, bit for bit."""

from __future__ import annotations

import glob
import os
import random
import shutil
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe

from harness import check_ok, run_ranks

NODES = {0: {"SHARDSAFE_NODE": "0"}, 1: {"SHARDSAFE_NODE": "0"}, 2: {"SHARDSAFE_NODE": "1"}, 3: {"SHARDSAFE_NODE": "1"}}
T = 3.0


def _values(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {
        "shared": torch.randn(32, generator=torch.Generator().manual_seed(step)),
        "mine": torch.randn(64, generator=g),
    }


def _state(rank: int, step: int) -> dict[str, Any]:
    v = _values(rank, step)
    return {"shared": v["shared"], "mine": v["mine"], "extra": {"step": step}}


def _train(rank: int, world: int, root: str, local: str, steps: int) -> None:
    tier = shardsafe.LocalTier(local, every_n_steps=1, replicas=1, keep=2)
    with shardsafe.CheckpointManager(root, every_n_steps=5, keep_last=3, local=tier, timeout=30) as mgr:
        for step in range(1, steps + 1):
            mgr.maybe_save(step, _state(rank, step))


def _resume(rank: int, world: int, cases: list[tuple[str, str]]) -> list[tuple[int | None, bool]]:
    out = []
    for root, local in cases:
        tier = shardsafe.LocalTier(local, every_n_steps=1, replicas=1, keep=2)
        with shardsafe.CheckpointManager(root, every_n_steps=5, keep_last=3, local=tier, timeout=30) as mgr:
            state = {"shared": torch.zeros(32), "mine": torch.zeros(64), "extra": {"step": -1}}
            step = mgr.resume(state)
            want = _values(rank, step or 0)
            exact = (
                step is not None
                and torch.equal(state["shared"], want["shared"])
                and torch.equal(state["mine"], want["mine"])
                and state["extra"] == {"step": step}
            )
            out.append((step, exact))
    return out


def _case(tmp: Path, trained: Path, name: str) -> tuple[str, str, Path]:
    dst = tmp / name
    shutil.copytree(trained, dst)
    return str(dst / "durable"), str(dst / "local-{node}"), dst


def _step(node: Path, step: int) -> Path:
    """The one save of ``step`` in a node folder's run (``run-<id>/step-<N>-<save id>``)."""
    (found,) = node.glob(f"run-*/step-{step:08d}-*")
    return found


def _steps(node: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in node.glob("run-*/step-*"))


def _corrupt_one_data_file(share: Path) -> None:
    data = sorted(p for p in share.rglob("*") if p.is_file() and p.name != "MANIFEST.json" and p.stat().st_size > 200)
    with open(data[0], "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))


def test_resume_from_local_tier_replicas_and_durable(tmp_path: Path) -> None:
    trained = tmp_path / "trained"
    check_ok(
        run_ranks(_train, 4, str(trained / "durable"), str(trained / "local-{node}"), 12, rank_env=NODES, timeout=90)
    )
    # retention: local steps 11 and 12 only (10 is durable), the durable store has 5 and 10
    for node in ("0", "1"):
        assert _steps(trained / f"local-{node}") == [11, 12]
    assert sorted(os.listdir(_step(trained / "local-0", 12))) == [
        "rank-00000",
        "rank-00001",
        "replica-of-rank-00002",
        "replica-of-rank-00003",
    ]

    _, _, lost_dir = c1 = _case(tmp_path, trained, "lost-node-1")
    shutil.rmtree(lost_dir / "local-1")
    _, _, all_dir = c2 = _case(tmp_path, trained, "all-lost")
    shutil.rmtree(all_dir / "local-0")
    shutil.rmtree(all_dir / "local-1")
    _, _, bad_dir = c3 = _case(tmp_path, trained, "corrupt")
    _corrupt_one_data_file(_step(bad_dir / "local-0", 12) / "rank-00000")
    _, _, gone_dir = c4 = _case(tmp_path, trained, "missing")
    shutil.rmtree(_step(gone_dir / "local-0", 12) / "rank-00001")
    shutil.rmtree(_step(gone_dir / "local-1", 12) / "replica-of-rank-00001")

    cases = [(c[0], c[1]) for c in (c1, c2, c3, c4)]
    results = check_ok(run_ranks(_resume, 4, cases, rank_env=NODES, timeout=120))
    for rank, per_case in enumerate(results):
        assert per_case == [(12, True), (10, True), (12, True), (11, True)], (rank, per_case)
    # the lost node's shares came back from their replicas, and count again as its own
    assert (_step(lost_dir / "local-1", 12) / "rank-00002" / "MANIFEST.json").exists()
    assert (_step(lost_dir / "local-1", 12) / "rank-00003" / "MANIFEST.json").exists()
    shardsafe.verify(_step(bad_dir / "local-0", 12) / "rank-00000")  # healed from the replica
    # the incomplete step 12 was dropped once step 11 was chosen
    assert 12 not in _steps(gone_dir / "local-0")


def test_local_tier_config_and_peers() -> None:
    from shardsafe.manager.tiers import node_identity, peers

    assert peers(["0", "0", "1", "1"], 0, 1) == [2]
    assert peers(["0", "0", "1", "1"], 3, 1) == [1]
    assert peers(["0", "0", "0"], 1, 1) == []  # one node: nowhere to replicate
    assert peers(["a", "b", "c"], 0, 2) == [1, 2]
    assert node_identity({"GROUP_RANK": "3"}) == "3"
    assert node_identity({"SHARDSAFE_NODE": "x", "SLURM_NODEID": "2"}) == "x"
    assert node_identity({}) == "0"
    for bad in ({"every_n_steps": 0}, {"replicas": -1}, {"keep": 0}):
        try:
            shardsafe.LocalTier("/tmp/x-{node}", **{"every_n_steps": 1, **bad})
        except shardsafe.InvalidArgumentError:
            continue
        raise AssertionError(bad)


# ------------------------------------------------------------------------------------ crashes


ROUNDS = int(os.environ.get("SHARDSAFE_TEST_TIER_CRASH_ROUNDS", "1"))


def _save_forever(rank: int, world: int, root: str, local: str, victim: int, delay: float) -> None:
    """Resume (the step and values are checked by the parent from the file this writes), then local
    saves until a rank fails; rank ``victim`` SIGKILLs itself ``delay`` seconds after resuming, at
    whatever instant of a save or replication that is. Rank 0 appends ``<step>`` to the progress file
    once a local save has returned."""
    tier = shardsafe.LocalTier(local, every_n_steps=1, replicas=1, keep=2)
    state = {"shared": torch.zeros(32), "mine": torch.zeros(64), "extra": {"step": -1}}
    with shardsafe.CheckpointManager(root, every_n_steps=10**9, local=tier, timeout=30) as first:
        step = first.resume(state) or 0  # a long deadline: a loaded machine must not fail the resume itself
    mgr = shardsafe.CheckpointManager(root, every_n_steps=10**9, keep_last=3, local=tier, timeout=T)
    want = _values(rank, step)
    exact = step == 0 or (torch.equal(state["mine"], want["mine"]) and torch.equal(state["shared"], want["shared"]))
    with open(f"{root}.resumed.{rank}", "a") as f:
        f.write(f"{step} {int(exact)}\n")
    progress = open(f"{root}.progress", "a")  # noqa: SIM115 - closed by the kill
    if rank == victim:
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
    while True:
        step += 1
        mgr.save_local(step, _state(rank, step))
        if rank == 0:
            progress.write(f"{step}\n")
            progress.flush()


def _check_entries(local_glob: str) -> int:
    """Every committed share or replica verifies and holds its own rank's values of its own step."""
    n = 0
    for manifest in glob.glob(os.path.join(local_glob, "run-*", "step-*", "*", "MANIFEST.json")):
        entry = os.path.dirname(manifest)
        name = os.path.basename(entry)
        if name.startswith(".incoming"):
            raise AssertionError(f"a transfer folder holds a committed manifest: {entry}")
        step = int(os.path.basename(os.path.dirname(entry)).split("-")[1])
        rank = int(name.rsplit("-", 1)[1])
        shardsafe.verify(entry)
        got = shardsafe.load(entry)
        want = _values(rank, step)
        assert torch.equal(got["mine"], want["mine"]) and got["extra"] == {"step": step}, entry
        n += 1
    return n


def _last(path: str) -> int:
    try:
        lines = Path(path).read_text().split()
    except FileNotFoundError:
        return 0
    return int(lines[-1]) if lines else 0


def test_kill_during_local_save_or_replication_leaves_nothing_inconsistent(tmp_path: Path) -> None:
    seed = int(os.environ.get("SHARDSAFE_TEST_SEED", random.randrange(1 << 30)))
    print(f"tier crash rounds: {ROUNDS}, seed {seed}")
    rng = random.Random(seed)
    root, local = str(tmp_path / "durable"), str(tmp_path / "local-{node}")
    for n in range(ROUNDS + 1):
        committed_before = _last(f"{root}.progress")
        victim = rng.randrange(4)
        delay = rng.uniform(0.05, 1.0)
        outcomes = run_ranks(_save_forever, 4, root, local, victim, delay, rank_env=NODES, timeout=T + 30)
        lines = [Path(f"{root}.resumed.{r}").read_text().splitlines() for r in range(4)]
        why = "; ".join(f"rank {o.rank}: {o.error_type}: {(o.error or '')[:2000]}" for o in outcomes)
        assert all(len(x) == n + 1 for x in lines), f"round {n}: some rank did not resume: {why}"
        resumed = [x[-1].split() for x in lines]
        steps = {int(s) for s, _ in resumed}
        assert len(steps) == 1, f"round {n}: ranks resumed different steps {resumed}"
        assert all(e == "1" for _, e in resumed), f"round {n}: a rank's values differ from its step: {resumed}"
        assert steps.pop() >= committed_before, f"round {n}: resumed older than step {committed_before}"
        assert outcomes[victim].exitcode == -signal.SIGKILL, f"round {n}: {why}"
        survivors = [o for o in outcomes if o.rank != victim]
        for o in survivors:
            assert o.error_type is not None and not o.killed, f"round {n}: rank {o.rank} did not raise: {why}"
        _check_entries(str(tmp_path / "local-*"))
        if rng.random() < 0.3:  # the dead rank's node is lost with it
            shutil.rmtree(tmp_path / f"local-{NODES[victim]['SHARDSAFE_NODE']}", ignore_errors=True)


def test_an_uncommitted_share_folder_loses_only_what_shardsafe_writes(tmp_path: Path) -> None:
    """Retention of a share whose save crashed (no manifest): its data files and temporary manifest go,
    a file shardsafe did not write stays, and so does the folder holding it."""
    from shardsafe.format.names import data_file
    from shardsafe.manager.tiers import new_save_id, remove_entry, share_name, step_folder

    run = "0123456789abcdef"
    share = Path(step_folder(str(tmp_path), run, 3, new_save_id(), create=True)) / share_name(1)
    share.mkdir()
    for name in (data_file(0, "abc"), ".MANIFEST.json.tmp-abc", "notes.txt"):
        (share / name).write_bytes(b"x")
    assert not remove_entry(str(share), run)
    assert sorted(os.listdir(share)) == ["notes.txt"]
    (share / "notes.txt").unlink()
    (share / data_file(0, "abc")).write_bytes(b"x")
    assert remove_entry(str(share), run)
    assert not share.exists() and not share.parent.exists()


def test_a_replica_request_without_the_server_token_is_refused(tmp_path: Path) -> None:
    """Anything on the network that reaches a replica server's port, without the token published
    through the store, can neither push files into the node folder nor pull a share out of it."""
    from shardsafe.deadline import Deadline
    from shardsafe.manager import replica
    from shardsafe.manager.tiers import new_save_id, share_name, step_folder

    run, save = "0123456789abcdef", new_save_id()
    meta = {"step": 3, "rank": 1, "world_size": 2, "run": run, "save": save, "incarnation": "0" * 16}
    share = str(tmp_path / "share")
    shardsafe.save(share, {"w": torch.arange(8.0)}, metadata=meta)
    folder = tmp_path / "node"
    server = replica.ReplicaServer(str(folder), 0, "127.0.0.1")
    try:
        for token in ("", "0" * 32):
            with pytest.raises(shardsafe.CheckpointError, match="token refused"):
                replica.push(server.address, token, share, meta, Deadline.after(20, "io"))
        assert not folder.exists() or not any(folder.rglob("*")), list(folder.rglob("*"))
        replica.push(server.address, server.token, share, meta, Deadline.after(20, "io"))  # the job's own rank
        thief = step_folder(str(tmp_path / "thief"), run, 3, save, create=True)
        for token in ("", "0" * 32):
            with pytest.raises(shardsafe.CheckpointError, match="token refused"):
                replica.pull(server.address, token, "replica-of-rank-00001", thief, meta, Deadline.after(20, "io"))
        assert not any((tmp_path / "thief").rglob("*.safetensors"))
        got = replica.pull(server.address, server.token, "replica-of-rank-00001", thief, meta, Deadline.after(20, "io"))
        assert os.path.basename(got) == share_name(1) and shardsafe.load(got)["w"].equal(torch.arange(8.0))
    finally:
        server.close()
