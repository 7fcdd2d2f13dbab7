"""The cost of progress reporting: 2-rank saves and loads of one state, in one session, with progress
reporting at its quietest (``SHARDSAFE_PROGRESS_INTERVAL`` far beyond the operation: each rank posts
its counts twice, rank 0 reads them once at the end), at the default interval with a callback, and
every 0.05 s with a callback (40 times the default rate). The settings alternate within each
repetition; a row is the median of the slowest rank's time.

    python bench/progress.py --size-mib 256 --reps 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
from ranks import run_session  # bench/ is on the path when this runs as a script

SETTINGS = {"quiet": ("1000000", False), "default": ("2", True), "every 0.05 s": ("0.05", True)}


def _session(rank: int, world: int, root: str, size_mib: int, reps: int) -> dict[str, dict[str, list[float]]]:
    import torch.distributed as dist

    import shardsafe

    rows = max(1, size_mib * 2**20 // 4 // 4096 // 4)
    state = {f"t{i}": torch.full((rows, 4096), float(i)) for i in range(4)}  # replicated: both ranks write
    times: dict[str, dict[str, list[float]]] = {op: {k: [] for k in SETTINGS} for op in ("save", "load")}
    calls = 0

    def count(_p: Any) -> None:
        nonlocal calls
        calls += 1

    order = list(SETTINGS)
    for rep in range(reps):
        for name in order if rep % 2 == 0 else order[::-1]:
            interval, callback = SETTINGS[name]
            os.environ["SHARDSAFE_PROGRESS_INTERVAL"] = interval
            path = os.path.join(root, f"r{rep}-{name.replace(' ', '_')}")
            dist.barrier()
            t = time.perf_counter()
            kw = {"progress": count} if callback and hasattr(shardsafe, "Progress") else {}  # older: none
            shardsafe.save(path, state, **kw)
            times["save"][name].append(time.perf_counter() - t)
            dist.barrier()
            t = time.perf_counter()
            shardsafe.load(path, state, **kw)
            times["load"][name].append(time.perf_counter() - t)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path)
    return times


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    args = p.parse_args(argv)
    root = tempfile.mkdtemp(prefix="shardsafe-progress-bench-", dir=args.dir)
    try:
        per_rank = run_session(_session, 2, root, args.size_mib, args.reps, timeout=1800)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"2 ranks, {args.size_mib} MiB state (replicated, both ranks write half), {args.reps} repetitions")
    print(f"{'op':<6}{'progress':<16}{'median s':>10}{'vs quiet':>10}")
    for op in ("save", "load"):
        slowest = {k: [max(r[op][k][i] for r in per_rank) for i in range(args.reps)] for k in SETTINGS}
        base = statistics.median(slowest["quiet"])
        for k in SETTINGS:
            med = statistics.median(slowest[k])
            print(f"{op:<6}{k:<16}{med:>10.3f}{med / base:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
