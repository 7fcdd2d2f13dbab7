"""The cost of checking replicated tensors (engine/replicas.py): 2-rank saves of one DDP-like state of
many tensors, in one session, with the check off, on (the default sample) and hashing every byte (a
sample as large as the state). The settings alternate within each repetition; a row is the median of
the slowest rank's time, and the time ``digests()`` itself takes on the rank that spends longest. A
save before the measured ones pays for the imports and first page faults.

    python bench/replicas.py --size-mib 256 --tensors 200 --reps 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
from ranks import run_session  # bench/ is on the path when this runs as a script

SETTINGS = {"off": ("off", None), "sampled (default)": ("refuse", None), "every byte": ("refuse", str(2**40))}


def _session(
    rank: int, world: int, root: str, size_mib: int, tensors: int, reps: int
) -> dict[str, dict[str, list[float]]]:
    import torch.distributed as dist

    import shardsafe
    from shardsafe.engine import replicas
    from shardsafe.state.flatten import flatten

    rows = max(1, size_mib * 2**20 // 4 // 1024 // tensors)
    state = {"model": {f"t{i}": torch.full((rows, 1024), float(i)) for i in range(tensors)}}  # the same on both
    times: dict[str, dict[str, list[float]]] = {"save": {k: [] for k in SETTINGS}, "digests": {k: [] for k in SETTINGS}}
    order = list(SETTINGS)
    flat = flatten(state, allow_pickle=False)
    shardsafe.save(os.path.join(root, "warm-up"), state)  # the first save pays for imports and page faults
    for rep in range(reps):
        for name in order[rep % len(order) :] + order[: rep % len(order)]:  # each setting first in turn
            mode, sample = SETTINGS[name]
            os.environ["SHARDSAFE_REPLICA_CHECK"] = mode
            if sample is None:
                os.environ.pop("SHARDSAFE_REPLICA_SAMPLE_BYTES", None)
            else:
                os.environ["SHARDSAFE_REPLICA_SAMPLE_BYTES"] = sample
            t = time.perf_counter()
            replicas.digests(flat)
            times["digests"][name].append(time.perf_counter() - t)
            path = os.path.join(root, f"r{rep}-{mode}-{sample}")
            dist.barrier()
            t = time.perf_counter()
            shardsafe.save(path, state)
            times["save"][name].append(time.perf_counter() - t)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path)
    return times


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--tensors", type=int, default=200)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    args = p.parse_args(argv)
    root = tempfile.mkdtemp(prefix="shardsafe-replicas-bench-", dir=args.dir)
    try:
        per_rank = run_session(_session, 2, root, args.size_mib, args.tensors, args.reps, timeout=1800)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"2 ranks, {args.size_mib} MiB replicated state in {args.tensors} tensors (each rank writes half, "
        f"digests all), {args.reps} repetitions, torch {torch.__version__}"
    )
    print(f"{'check':<20}{'save median s':>14}{'vs off':>8}{'digests s':>11}")
    slowest = {k: [max(r["save"][k][i] for r in per_rank) for i in range(args.reps)] for k in SETTINGS}
    base = statistics.median(slowest["off"])
    for k in SETTINGS:
        med = statistics.median(slowest[k])
        dig = statistics.median(max(r["digests"][k][i] for r in per_rank) for i in range(args.reps))
        print(f"{k:<20}{med:>14.3f}{med / base:>8.3f}{dig:>11.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
