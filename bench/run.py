"""Benchmark shardsafe against torch.save, DCP, Lightning Fabric and the storage floors, in one run.

    python bench/run.py [--size-mib 1024] [--reps 3] [--out bench/results] [--baseline REV]

Runs a 2-rank session (gloo on CPU, spawned ranks) for replicated (DDP) and for sharded (FSDP2) state,
then the resharded loads (2 -> 1 plain process; FSDP2 2 -> 3), and writes ``results.json``,
``results.md`` and ``results.png`` under ``--out``. Checkpoints go to a scratch directory under
``--out`` (the disk under test), deleted as soon as each is measured. ``--baseline REV`` adds shardsafe
as it was at git revision REV as one more contender, in the same sessions and the same running order, so that
a change is measured against what came before in one run (see bench/baseline.py). See bench/README.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:  # run as a script: make the ``bench`` package importable here and in the ranks
    sys.path.insert(0, _REPO)

CONTENDERS = ("floor", "torch", "dcp", "fabric", "shardsafe")
KINDS = ("replicated", "sharded")
_NEEDS = {"torch": "torch", "xxhash": "xxhash", "matplotlib": "matplotlib"}
_NEEDS_FOR = {"fabric": "lightning", "shardsafe": "shardsafe", "baseline": "shardsafe"}


def _missing(contenders: list[str]) -> list[str]:
    needed = list(_NEEDS.values()) + [_NEEDS_FOR[c] for c in contenders if c in _NEEDS_FOR]
    return [m for m in needed if importlib.util.find_spec(m) is None]


def _cmd(*args: str) -> str:
    try:
        return subprocess.run(args, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as err:
        return f"unavailable ({err})"


def _version(module: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return None
    mod = __import__(module)
    return str(getattr(mod, "__version__", "unknown"))


def _origin(module: str) -> str | None:
    spec = importlib.util.find_spec(module)
    return spec.origin if spec is not None else None


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def machine(scratch: str) -> dict[str, Any]:
    """What the numbers were taken on: cores, memory, the disk under the scratch directory, versions."""
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "memory": _cmd("free", "-h"),
        "disk": _cmd("df", "-hT", scratch),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "lightning": _version("lightning"),
        "shardsafe": _version("shardsafe"),
        "shardsafe_from": _origin("shardsafe"),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "loadavg_at_end": _loadavg(),
    }


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=1024, help="state size in MiB, model + Adam (default 1024)")
    p.add_argument("--reps", type=int, default=3, help="repetitions; rows report the median (default 3)")
    p.add_argument("--out", default=os.path.join(_REPO, "bench", "results"), help="output directory")
    p.add_argument(
        "--contenders", default=",".join(CONTENDERS), help="comma-separated subset of " + ", ".join(CONTENDERS)
    )
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated subset of " + ", ".join(KINDS))
    p.add_argument("--warm", action="store_true", help="do not drop the page cache before loads")
    p.add_argument("--baseline", default="", help="a git revision of shardsafe to measure beside this one")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one session may take (default 1800)")
    args = p.parse_args(argv)
    args.contenders = [c for c in args.contenders.split(",") if c]
    args.kinds = [k for k in args.kinds.split(",") if k]
    for name, chosen, allowed in (("--contenders", args.contenders, CONTENDERS), ("--kinds", args.kinds, KINDS)):
        bad = [c for c in chosen if c not in allowed]
        if bad or not chosen:
            p.error(f"{name}: {bad or 'nothing'} not in {', '.join(allowed)}")
    if args.baseline and "baseline" not in args.contenders:
        args.contenders.append("baseline")
    if args.size_mib < 1 or args.reps < 1:
        p.error("--size-mib and --reps must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    missing = _missing(args.contenders)
    if missing:
        print(
            f"bench: missing Python packages {', '.join(missing)}. Install them with\n"
            f"  {sys.executable} -m pip install -r requirements-bench.txt\n"
            "(shardsafe itself: pip install -e .), or leave their contenders out with --contenders.",
            file=sys.stderr,
        )
        return 2

    from bench.contenders import RESHARDING
    from bench.measure import drop_page_cache
    from bench.ranks import run_session
    from bench.report import write_report
    from bench.session import SessionConfig, main_session, reshard_session

    os.makedirs(args.out, exist_ok=True)
    scratch = os.path.join(os.path.abspath(args.out), f"ckpt-{os.getpid()}.tmp")
    os.makedirs(scratch)
    if args.baseline:
        from bench.baseline import ENV, make_baseline

        os.environ[ENV] = str(make_baseline(args.baseline, Path(scratch) / "baseline"))
    cold = not args.warm and drop_page_cache()
    if not args.warm and not cold:
        print("bench: the kernel refused to drop the page cache; loads are measured warm", file=sys.stderr)
    started = time.monotonic()
    loadavg_at_start = _loadavg()
    commit = _cmd("git", "-C", _REPO, "rev-parse", "HEAD")
    samples: list[dict[str, Any]] = []
    states: dict[str, Any] = {}
    try:
        for kind in args.kinds:
            root = os.path.join(scratch, kind)
            cfg = SessionConfig(
                kind=kind,
                size_bytes=args.size_mib << 20,
                reps=args.reps,
                root=root,
                cold=cold,
                contenders=tuple(args.contenders),
                sources=os.path.join(root, "sources"),
            )
            os.makedirs(cfg.sources)
            t0 = time.monotonic()
            results = run_session(main_session, 2, cfg, timeout=args.timeout)
            print(f"bench: {kind} session on 2 ranks took {time.monotonic() - t0:.0f} s", flush=True)
            states[kind] = {k: v for k, v in results[0].items() if k != "samples"}
            states[kind]["local_bytes"] = [r["local_bytes"] for r in results]
            samples += [s for r in results for s in r["samples"]]
            reshard_worlds = (1, 3) if kind == "sharded" else (1,)
            for world in reshard_worlds if any(c in RESHARDING for c in args.contenders) else ():
                t0 = time.monotonic()
                results = run_session(reshard_session, world, cfg, 2, timeout=args.timeout, process_group=world > 1)
                print(f"bench: {kind} 2 -> {world} reshard session took {time.monotonic() - t0:.0f} s", flush=True)
                samples += [s for r in results for s in r["samples"]]
            shutil.rmtree(root)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report = {
        "config": {
            "size_mib": args.size_mib,
            "reps": args.reps,
            "contenders": args.contenders,
            "kinds": args.kinds,
            "cold_loads": cold,
            "ranks": 2,
            "backend": "gloo (CPU)",
            "baseline": _cmd("git", "-C", _REPO, "rev-parse", args.baseline) if args.baseline else None,
        },
        "machine": {**machine(os.path.abspath(args.out)), "loadavg_at_start": loadavg_at_start, "repo_commit": commit},
        "states": states,
        "elapsed_seconds": time.monotonic() - started,
        "samples": samples,
    }
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(report, f, indent=1)
    markdown = write_report(report, args.out)
    print(markdown)
    print(
        f"bench: wrote results.json, results.md and results.png under {args.out} in {report['elapsed_seconds']:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
