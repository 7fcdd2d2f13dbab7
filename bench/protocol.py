"""The cost of the protocol itself: a tiny-state save and load on N CPU ranks, shardsafe against DCP (and,
with ``--baseline REV``, against shardsafe as it was at git revision REV), in the same sessions, in
an order that changes every repetition (``bench.session.order``).

    .venv/bin/python bench/protocol.py --ranks 2,4,8,16,32 --reps 7
    .venv/bin/python bench/protocol.py --ranks 16 --reps 5 --baseline 8170229   # against an older main

The state is one ``nn.Linear(8, 8)`` (plain, the same on every rank) and a step counter: what is timed
is coordination, not bytes. Every repetition starts on a gloo barrier; a row's time is the median over
repetitions of the slowest rank's time. The contenders run in an order that rotates every repetition.
The store requests of one save and one load are counted on every rank (shardsafe's own tally; for the
baseline, every call its store-access function made): the table reports rank 0's and the others'
most, per operation, so that growth with the number of ranks shows.

The baseline is the ``src/shardsafe`` tree of REV (``git archive``), imported under the name
``shardsafe_base`` so that both run in the same processes.

Writes ``bench/results/protocol.{json,md}`` (``--out``)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "src"))

from bench.baseline import import_baseline, make_baseline  # noqa: E402
from bench.ranks import run_session  # noqa: E402
from bench.session import order  # noqa: E402


def _count_baseline(base: Any) -> Counter[str]:
    """Count every store call the baseline makes through its access functions."""
    counts: Counter[str] = Counter()
    if not hasattr(base.coord, "access"):  # a revision with the one store client: its own tally counts
        return counts
    access = base.coord.access
    real = access.guarded

    def counted(fn: Any, lost: Any) -> Any:
        counts["call"] += 1
        return real(fn, lost)

    access.guarded = counted
    for mod in (base.coord.agreement,):
        if hasattr(mod, "guarded"):
            mod.guarded = counted
    return counts


def _session(rank: int, world: int, root: str, reps: int, contenders: list[str], baseline: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import shardsafe
    from shardsafe.coord.operation import LAST_TALLY

    base: Any = None
    base_counts: Counter[str] = Counter()
    if baseline:
        base = import_baseline(baseline)
        base_counts = _count_baseline(base)

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    state = {"model": model, "step": 1}

    def run(name: str, what: str, path: str) -> None:
        if name == "shardsafe":
            if what == "save":
                shardsafe.save(path, state, overwrite=True)
            else:
                shardsafe.load(path, state)
        elif name == "baseline":
            if what == "save":
                base.save(path, state, overwrite=True)
            else:
                base.load(path, state)
        elif what == "save":
            dcp.save({"model": model.state_dict(), "step": 1}, checkpoint_id=path)
        else:
            sd = {"model": model.state_dict(), "step": 1}
            dcp.load(sd, checkpoint_id=path)
            model.load_state_dict(sd["model"])

    times: dict[str, list[float]] = {f"{c}.{w}": [] for c in contenders for w in ("save", "load")}
    requests: dict[str, Any] = {}
    for rep in range(-1, reps):  # rep -1 warms up (connections, imports, caches)
        for name in order(contenders, rep):
            path = f"{root}/{name}"
            for what in ("save", "load"):
                dist.barrier()
                before = base_counts["call"]
                t = time.perf_counter()
                run(name, what, path)
                took = time.perf_counter() - t
                if rep >= 0:
                    times[f"{name}.{what}"].append(took)
                if rep == 0 and name == "shardsafe":
                    requests[what] = LAST_TALLY[what].as_dict()
                if rep == 0 and name == "baseline":
                    tally = getattr(getattr(base.coord, "operation", None), "LAST_TALLY", {}).get(what)
                    requests[f"baseline.{what}"] = tally.as_dict() if tally else base_counts["call"] - before
    dist.barrier()
    return {"times": times, "requests": requests}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,4,8,16,32", help="comma-separated numbers of ranks")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--baseline", default="", help="a git revision of shardsafe to run beside this one")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per session")
    args = ap.parse_args()
    contenders = ["shardsafe", "dcp"] + (["baseline"] if args.baseline else [])
    os.makedirs(args.out, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="shardsafe-protocol-", dir=args.out))
    basedir = ""
    if args.baseline:
        basedir = str(make_baseline(args.baseline, scratch / "base"))
    rows: list[dict[str, Any]] = []
    try:
        for world in [int(x) for x in args.ranks.split(",")]:
            root = scratch / f"w{world}"
            root.mkdir()
            started = time.monotonic()
            per_rank = run_session(_session, world, str(root), args.reps, contenders, basedir, timeout=args.timeout)
            row: dict[str, Any] = {"ranks": world, "session_seconds": time.monotonic() - started}
            for key in per_rank[0]["times"]:
                slowest = [max(r["times"][key][i] for r in per_rank) for i in range(args.reps)]
                row[key] = statistics.median(slowest)
            for what in ("save", "load"):
                tallies = [r["requests"][what]["waited"] for r in per_rank]
                row[f"requests.{what}.rank0"] = sum(tallies[0].values())
                row[f"requests.{what}.others"] = max((sum(t.values()) for t in tallies[1:]), default=0)
                posted = [r["requests"][what]["posted"] for r in per_rank]
                row[f"posted.{what}.rank0"] = sum(posted[0].values())
                row[f"posted.{what}.others"] = max((sum(t.values()) for t in posted[1:]), default=0)
                if args.baseline:
                    calls = [_waited(r["requests"][f"baseline.{what}"]) for r in per_rank]
                    row[f"baseline.requests.{what}.rank0"] = calls[0]
                    row[f"baseline.requests.{what}.others"] = max(calls[1:], default=0)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report(rows, args, contenders)


def _waited(calls: Any) -> int:
    """A baseline's store requests: its own tally's waited ones (a recent revision), or its call count."""
    return sum(calls["waited"].values()) if isinstance(calls, dict) else int(calls)


def report(rows: list[dict[str, Any]], args: Any, contenders: list[str]) -> None:
    out = Path(args.out)
    import torch

    meta = {
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "reps": args.reps,
        "baseline": args.baseline,
    }
    (out / "protocol.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    head = "| ranks | shardsafe save | DCP save | ratio | shardsafe load | DCP load | ratio |"
    sep = "|---:|---:|---:|---:|---:|---:|---:|"
    if args.baseline:
        head += f" {args.baseline} save | {args.baseline} load |"
        sep += "---:|---:|"
    lines = [
        f"# Protocol cost ({meta['when']}, {meta['machine']}, torch {meta['torch']}, median of {args.reps})",
        "",
        "Milliseconds for a tiny state (one `nn.Linear(8, 8)` and a step counter), slowest rank, median.",
        "",
        head,
        sep,
    ]
    for r in rows:
        line = (
            f"| {r['ranks']} | {1e3 * r['shardsafe.save']:.1f} | {1e3 * r['dcp.save']:.1f} | "
            f"{r['shardsafe.save'] / r['dcp.save']:.2f}x | {1e3 * r['shardsafe.load']:.1f} | "
            f"{1e3 * r['dcp.load']:.1f} | {r['shardsafe.load'] / r['dcp.load']:.2f}x |"
        )
        if args.baseline:
            line += f" {1e3 * r['baseline.save']:.1f} | {1e3 * r['baseline.load']:.1f} |"
        lines.append(line)
    lines += [
        "",
        "Store requests per rank (answered requests; posted ones, not waited for, in brackets):",
        "",
        "| ranks | save: rank 0 | save: others | load: rank 0 | load: others |"
        + (" baseline save: rank 0 / others | baseline load: rank 0 / others |" if args.baseline else ""),
        "|---:|---:|---:|---:|---:|" + ("---:|---:|" if args.baseline else ""),
    ]
    for r in rows:
        line = (
            f"| {r['ranks']} | {r['requests.save.rank0']} ({r['posted.save.rank0']}) | "
            f"{r['requests.save.others']} ({r['posted.save.others']}) | {r['requests.load.rank0']} "
            f"({r['posted.load.rank0']}) | {r['requests.load.others']} ({r['posted.load.others']}) |"
        )
        if args.baseline:
            line += (
                f" {r['baseline.requests.save.rank0']} / {r['baseline.requests.save.others']} |"
                f" {r['baseline.requests.load.rank0']} / {r['baseline.requests.load.others']} |"
            )
        lines.append(line)
    (out / "protocol.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
