"""Incremental saves: bytes written and save time of ``shardsafe.save(path, state, base=BASE)`` against a
full ``shardsafe.save(path, state)`` of the same state, for 0%, 50% and 90% of the state frozen
(unchanged since BASE), in one run.

    .venv/bin/python bench/incremental.py [--size-mib 512] [--reps 3] [--out bench/results]

The state is 20 equal float32 tensors; a "frozen" fraction of them keeps its values, the others
change before every save (as a training step would). Each repetition saves the base in full, changes
the unfrozen tensors, then saves the same state in full and incrementally (in alternating order), each
into a new directory, fsync included (every shardsafe save is durable when it returns; ``sync`` runs
before each timed save, so none pays for another's write-back). One process.
Bytes written are the sizes of the files each save created (data files and manifest). Rows report
the median; the ratio is incremental / full. Writes ``incremental.json`` and ``incremental.md`` under
``--out``; checkpoints go to a scratch directory there, deleted after each repetition.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

import shardsafe  # noqa: E402

TENSORS = 20
FROZEN = (0.0, 0.5, 0.9)


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _state(size_mib: int) -> dict[str, Any]:
    rows = max(1, (size_mib << 20) // TENSORS // (4 * 1024))
    g = torch.Generator().manual_seed(0)
    return {f"t{i:02d}": torch.randn(rows, 1024, generator=g) for i in range(TENSORS)}


def _timed(path: Path, state: dict[str, Any], base: Path | None) -> tuple[float, int]:
    os.sync()  # no save pays for the write-back of the one before
    t0 = time.perf_counter()
    shardsafe.save(path, state, base=base)
    return time.perf_counter() - t0, _bytes(path)


def measure(size_mib: int, reps: int, scratch: Path) -> list[dict[str, Any]]:
    rows = []
    state = _state(size_mib)
    names = sorted(state)
    for frozen in FROZEN:
        changing = names[round(frozen * TENSORS) :]
        runs: dict[str, list[tuple[float, int]]] = {"full": [], "incremental": []}
        for rep in range(reps):
            root = scratch / f"f{int(frozen * 100)}-{rep}"
            _timed(root / "base", state, None)
            for name in changing:
                state[name].add_(1.0)
            order = ["full", "incremental"] if rep % 2 == 0 else ["incremental", "full"]
            for kind in order:
                runs[kind].append(_timed(root / kind, state, root / "base" if kind == "incremental" else None))
            out = shardsafe.load(root / "incremental")
            assert all(torch.equal(out[k], state[k]) for k in names), "incremental save did not load equal"
            shardsafe.verify(root / "incremental")
            shutil.rmtree(root)
        full_s = statistics.median(t for t, _ in runs["full"])
        inc_s = statistics.median(t for t, _ in runs["incremental"])
        full_b = statistics.median(b for _, b in runs["full"])
        inc_b = statistics.median(b for _, b in runs["incremental"])
        rows.append(
            {
                "frozen": frozen,
                "full_seconds": full_s,
                "incremental_seconds": inc_s,
                "full_bytes": full_b,
                "incremental_bytes": inc_b,
                "bytes_ratio": inc_b / full_b,
                "time_ratio": inc_s / full_s,
                "samples": runs,
            }
        )
        print(
            f"frozen {frozen:.0%}: full {full_b / 2**20:.1f} MiB in {full_s:.2f}s, incremental "
            f"{inc_b / 2**20:.1f} MiB in {inc_s:.2f}s (bytes x{inc_b / full_b:.3f}, time x{inc_s / full_s:.2f})",
            flush=True,
        )
    return rows


def markdown(rows: list[dict[str, Any]], size_mib: int, reps: int) -> str:
    lines = [
        f"Incremental against full save, {size_mib} MiB state (20 float32 tensors), one process, median of {reps}.",
        "",
        "| frozen | full: MiB | full: s | incremental: MiB | incremental: s | bytes ratio | time ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['frozen']:.0%} | {r['full_bytes'] / 2**20:.1f} | {r['full_seconds']:.2f} | "
            f"{r['incremental_bytes'] / 2**20:.1f} | {r['incremental_seconds']:.2f} | "
            f"**{r['bytes_ratio']:.3f}** | **{r['time_ratio']:.2f}** |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=512, help="state size in MiB (default 512)")
    p.add_argument("--reps", type=int, default=3, help="repetitions; rows report the median (default 3)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"), help="output directory")
    args = p.parse_args(argv)
    out = Path(args.out)
    scratch = out / f"incremental-{os.getpid()}.tmp"
    scratch.mkdir(parents=True)
    try:
        rows = measure(args.size_mib, args.reps, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report = {"config": {"size_mib": args.size_mib, "reps": args.reps, "tensors": TENSORS}, "rows": rows}
    (out / "incremental.json").write_text(json.dumps(report, indent=1))
    text = markdown(rows, args.size_mib, args.reps)
    (out / "incremental.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
