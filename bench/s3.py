"""Object-storage throughput: shardsafe save and load against a local S3 endpoint (moto's standalone
server on loopback, s3fs as the client), parallel multipart uploads and ranged reads against a single
stream, in one run on the same state.

    .venv/bin/python bench/s3.py [--size-mib 256] [--reps 3] [--out bench/results]

Writes ``s3.json`` and ``s3.md`` under ``--out``. The server is pure Python and shares the machine's
cores with the client, so it caps both modes; the figures show what parallel parts cost here, not the
gain against a real S3 endpoint (see bench/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

MODES = {
    "parallel parts (4 upload threads, 4 read threads)": {
        "SHARDSAFE_REMOTE_UPLOAD_THREADS": "4",
        "SHARDSAFE_IO_THREADS": "4",
    },
    "single stream (1 upload thread, 1 read thread)": {
        "SHARDSAFE_REMOTE_UPLOAD_THREADS": "1",
        "SHARDSAFE_IO_THREADS": "1",
    },
}


def _state(size_mib: int) -> dict[str, torch.Tensor]:
    n = 4
    per = size_mib * 2**20 // 4 // n
    return {f"w{i}": torch.arange(per, dtype=torch.float32) + i for i in range(n)}


def _measure(url: str, state: dict[str, Any], options: dict[str, Any]) -> tuple[float, float]:
    import shardsafe

    start = time.perf_counter()
    shardsafe.save(url, state, overwrite=True, storage_options=options)
    saved = time.perf_counter() - start
    start = time.perf_counter()
    loaded = shardsafe.load(url, storage_options=options)
    read = time.perf_counter() - start
    for k, v in state.items():
        if not torch.equal(loaded[k], v):
            raise SystemExit(f"bench/s3.py: {url}: tensor {k} did not load back equal")
    return saved, read


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args(argv)
    try:
        from s3_server import S3Server
    except ImportError as err:
        print(f"bench/s3.py needs moto[server] and s3fs (requirements-dev.txt): {err}", file=sys.stderr)
        return 2
    state = _state(args.size_mib)
    samples: dict[str, dict[str, list[float]]] = {m: {"save": [], "load": []} for m in MODES}
    with S3Server() as server:
        bucket = server.new_bucket()
        for rep in range(args.reps):
            order = list(MODES) if rep % 2 == 0 else list(reversed(MODES))  # alternate who goes first
            for mode in order:
                os.environ.update(MODES[mode])
                url = f"s3://{bucket}/bench/{abs(hash(mode)) % 10_000}"
                saved, read = _measure(url, state, server.storage_options)
                samples[mode]["save"].append(saved)
                samples[mode]["load"].append(read)
                print(f"rep {rep} {mode}: save {saved:.2f}s, load {read:.2f}s", flush=True)
    mib = args.size_mib
    rows = []
    for mode, s in samples.items():
        save, load = statistics.median(s["save"]), statistics.median(s["load"])
        rows.append((mode, save, mib / save, load, mib / load))
    base = rows[1]
    lines = [
        f"# shardsafe on a local S3 endpoint: {mib} MiB state, one process, median of {args.reps}",
        "",
        f"moto {__import__('moto').__version__} standalone server on 127.0.0.1, s3fs client; "
        f"{time.strftime('%Y-%m-%d %H:%M %z')}; load average {os.getloadavg()[0]:.2f}.",
        "",
        "| mode | save s | save MiB/s | load s | load MiB/s | save vs single stream | load vs single stream |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, save, save_rate, load, load_rate in rows:
        lines.append(
            f"| {mode} | {save:.2f} | {save_rate:.0f} | {load:.2f} | {load_rate:.0f} | "
            f"{base[1] / save:.2f}x | {base[3] / load:.2f}x |"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "s3.md").write_text("\n".join(lines) + "\n")
    (out / "s3.json").write_text(json.dumps({"size_mib": mib, "samples": samples}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
