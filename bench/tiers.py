"""The node-local tier against durable-only managers, in one run: 4 CPU ranks as 2 simulated nodes
(ranks 0, 1 on node 0; 2, 3 on node 1), the same state on every contender.

- blocking time of a save: ``save_local`` (each rank's share to its node's folder, replicated to the
  peer node over sockets) against ``CheckpointManager.save`` to S3 (moto's server on loopback) and to
  a local-disk folder, median over ``--reps`` saves, the first left out (it warms up);
- recovery after losing node 1 (its local folder deleted): a fresh 4-rank job's ``resume``: from the
  local tier (ranks 2 and 3 pull their shares from the replicas on node 0) against resuming from the
  durable store (S3, local disk).

    .venv/bin/python bench/tiers.py [--mib-per-rank 32] [--reps 5] [--out bench/results]

Writes ``tiers.json`` and ``tiers.md``. One machine plays both nodes, so the "network" is loopback
and the "node-local disk" and the "durable disk" are the same disk: the local-disk contender is the
best case for a shared filesystem; moto is pure Python on the same cores (see bench/README.md)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from bench.ranks import run_session  # noqa: E402

WORLD = 4


def _tensors(rank: int, mib: int, step: int) -> dict[str, torch.Tensor]:
    n = mib * 2**20 // 4 // 2
    return {
        "shared": torch.arange(n, dtype=torch.float32) + step,
        "mine": torch.arange(n, dtype=torch.float32) * (rank + 1) + step,
    }


def _state(rank: int, mib: int, step: int) -> dict[str, Any]:
    """What each rank saves: ``mine`` differs between ranks (marked: larger than the per-rank digest
    limit, it would otherwise be taken as equal on every rank)."""
    import shardsafe

    t = _tensors(rank, mib, step)
    return {"shared": t["shared"], "mine": shardsafe.per_rank(t["mine"])}


def _manager(root: str, local: str | None) -> Any:
    import shardsafe

    tier = None if local is None else shardsafe.LocalTier(local, every_n_steps=1, replicas=1, keep=2)
    return shardsafe.CheckpointManager(
        root, every_n_steps=10**9, keep_last=2, local=tier, save_on_signals=(), timeout=300
    )


def _saves(rank: int, world: int, root: str, local: str | None, mib: int, reps: int) -> list[float]:
    os.environ["SHARDSAFE_NODE"] = str(rank // 2)
    out = []
    with _manager(root, local) as mgr:
        for step in range(1, reps + 1):
            state = _state(rank, mib, step)
            start = time.perf_counter()
            if local is not None:
                mgr.save_local(step, state)
            else:
                mgr.save(step, state)
            out.append(time.perf_counter() - start)
    return out


def _resume(rank: int, world: int, root: str, local: str | None, mib: int, step: int) -> tuple[float, int | None]:
    os.environ["SHARDSAFE_NODE"] = str(rank // 2)
    with _manager(root, local) as mgr:
        state = {k: torch.zeros_like(v) for k, v in _tensors(rank, mib, 0).items()}
        start = time.perf_counter()
        got = mgr.resume(state)
        took = time.perf_counter() - start
        want = _tensors(rank, mib, step)
        if got != step or any(not torch.equal(state[k], want[k]) for k in want):
            raise SystemExit(f"bench/tiers.py: rank {rank} resumed step {got}, not {step} bit for bit")
    return took, got


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib-per-rank", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args(argv)
    from s3_server import S3Server

    mib, reps = args.mib_per_rank, args.reps
    work = Path(tempfile.mkdtemp(prefix="shardsafe-bench-tiers-"))
    results: dict[str, dict[str, Any]] = {}
    try:
        with S3Server() as server:
            bucket = server.new_bucket()
            os.environ.update(
                AWS_ACCESS_KEY_ID="testing",
                AWS_SECRET_ACCESS_KEY="testing",
                AWS_ENDPOINT_URL=server.endpoint_url,
                AWS_DEFAULT_REGION="us-east-1",
            )
            contenders = {
                "local tier (node disk + peer replica)": (str(work / "unused-durable"), str(work / "local-{node}")),
                "durable only, S3 (moto)": (f"s3://{bucket}/run", None),
                "durable only, local disk": (str(work / "durable"), None),
            }
            for name, (root, local) in contenders.items():
                saves = run_session(_saves, WORLD, root, local, mib, reps, timeout=1200)
                per_save = [max(r[i] for r in saves) for i in range(reps)]  # the slowest rank blocks the job
                if local is not None:
                    shutil.rmtree(work / "local-1")  # node 1 is lost
                rec = run_session(_resume, WORLD, root, local, mib, reps, timeout=1200)
                results[name] = {
                    "save_s": per_save,
                    "save_median_s": statistics.median(per_save[1:] or per_save),  # the first one warms up
                    "recovery_s": max(t for t, _ in rec),
                }
                print(name, results[name], flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    local_name = next(iter(results))
    lines = [
        f"# Node-local tier vs durable-only: {WORLD} CPU ranks as 2 nodes, {mib} MiB per rank "
        f"({mib // 2} MiB replicated state + {mib // 2} MiB per-rank), median of saves 2..{reps} (the first warms up)",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M %z')}; load average {os.getloadavg()[0]:.2f}; one machine plays both "
        "nodes (loopback network, one disk).",
        "",
        "| contender | save blocking s (median) | recovery after losing node 1, s | save vs local tier | "
        "recovery vs local tier |",
        "|---|---:|---:|---:|---:|",
    ]
    base = results[local_name]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['save_median_s']:.3f} | {r['recovery_s']:.3f} | "
            f"{r['save_median_s'] / base['save_median_s']:.2f}x | {r['recovery_s'] / base['recovery_s']:.2f}x |"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tiers.md").write_text("\n".join(lines) + "\n")
    (out / "tiers.json").write_text(json.dumps({"mib_per_rank": mib, "reps": reps, "results": results}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
