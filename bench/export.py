"""Export to the Hugging Face layout: peak memory and time of ``shardsafe.export_hf`` on a 1 GiB
checkpoint written by 2 FSDP2 ranks, against what a user would do without it (load the whole model,
then ``huggingface_hub.save_torch_state_dict``, the sharded writer ``save_pretrained`` uses) and against
the floor (copying the checkpoint's data files), in one run.

    .venv/bin/python bench/export.py [--size-mib 1024] [--reps 3] [--max-shard-size 300MB] [--out bench/results]

Each measurement runs in a fresh process, after its imports: peak extra memory is the kernel's VmHWM
(reset through /proc/self/clear_refs) above the resident set just before the operation. Every row
includes fsync of what it wrote; reads start from a dropped page cache when the kernel allows it.
The target: the export's peak stays under 1.3x (largest tensor + largest shard written). Writes
``export.json`` and ``export.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LARGEST_SHARE = 4  # the embedding holds 1/4 of the state; 12 equal layers share the rest
LAYERS = 12
CONTENDERS = {
    "shardsafe.export_hf": "shardsafe export CKPT OUT (float32)",
    "shardsafe.export_hf bf16": "shardsafe export CKPT OUT --dtype bfloat16",
    "load + save_torch_state_dict": "shardsafe.load(CKPT) then huggingface_hub.save_torch_state_dict",
    "floor: copy the data files": "read every data file and write it to a new file (16 MiB pieces), fsync",
}


def _shapes(size_mib: int) -> dict[str, tuple[int, int]]:
    total = size_mib * 2**20 // 4  # float32 elements
    cols = 1024
    emb_rows = total // LARGEST_SHARE // cols
    side = int(((total - emb_rows * cols) // LAYERS) ** 0.5)
    shapes = {"embed.weight": (emb_rows, cols)}
    shapes.update({f"layers.{i}.weight": (side, side) for i in range(LAYERS)})
    return shapes


def _save_rank(rank: int, world: int, path: str, size_mib: int) -> None:
    """(every rank) Build the model, shard it with FSDP2 and save it with shardsafe."""
    import torch
    from torch.distributed.fsdp import fully_shard

    import shardsafe

    torch.manual_seed(0)
    module = torch.nn.Module()
    for name, shape in _shapes(size_mib).items():
        parent = module
        *heads, leaf = name.split(".")
        for head in heads:
            if not hasattr(parent, head):
                parent.add_module(head, torch.nn.Module())
            parent = getattr(parent, head)
        parent.register_parameter(leaf, torch.nn.Parameter(torch.randn(shape)))
    fully_shard(module)
    shardsafe.save(path, {"model": module, "step": 1}, timeout=600)


# ------------------------------------------------------------------------------------- one measurement


def _measure(contender: str, ckpt: str, out: str, shard: str) -> dict[str, Any]:
    """(a fresh process) Run one contender; its seconds, peak extra bytes and the files it wrote."""
    import torch  # noqa: F401  (imported before the baseline, like every contender's libraries)

    import shardsafe
    from bench.measure import _reset_peak, _status_kib

    assert shardsafe.export_hf  # the API is imported on first use: before the baseline

    if contender.startswith("load"):
        from huggingface_hub import save_torch_state_dict
    rss = _status_kib("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    if contender == "shardsafe.export_hf":
        shardsafe.export_hf(ckpt, out, max_shard_size=shard)
    elif contender == "shardsafe.export_hf bf16":
        shardsafe.export_hf(ckpt, out, max_shard_size=shard, dtype="bfloat16")
    elif contender.startswith("load"):
        state = shardsafe.load(ckpt)["model"]
        os.mkdir(out)
        save_torch_state_dict(state, out, max_shard_size=shard)
        _fsync_tree(out)
    else:
        os.mkdir(out)
        buf = bytearray(16 * 2**20)
        for name in sorted(os.listdir(ckpt)):
            with open(os.path.join(ckpt, name), "rb", buffering=0) as src, open(os.path.join(out, name), "wb") as dst:
                while n := src.readinto(buf):
                    dst.write(memoryview(buf)[:n])
                dst.flush()
                os.fsync(dst.fileno())
    seconds = time.perf_counter() - t0
    peak = (_status_kib("VmHWM") - rss) * 1024
    files = {p.name: p.stat().st_size for p in Path(out).iterdir() if p.suffix == ".safetensors"}
    return {"seconds": seconds, "peak_extra_bytes": max(0, peak), "files": files}


def _fsync_tree(path: str) -> None:
    for name in os.listdir(path):
        with open(os.path.join(path, name), "rb") as f:
            os.fsync(f.fileno())


def _child(contender: str, ckpt: str, out: str, shard: str, cold: bool) -> dict[str, Any]:
    if cold:
        from bench.measure import drop_page_cache

        cold = drop_page_cache()
    cmd = [sys.executable, __file__, "--child", contender, "--ckpt", ckpt, "--child-out", out]
    cmd += ["--max-shard-size", shard]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, check=False)
    if done.returncode != 0:
        raise SystemExit(f"bench/export.py: {contender} failed:\n{done.stderr[-4000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "cold": cold}


# ------------------------------------------------------------------------------------------ the run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-shard-size", default="300MB")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--warm", action="store_true", help="do not drop the page cache before each row")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_measure(args.child, args.ckpt, args.child_out, args.max_shard_size)))
        return 0
    try:
        import huggingface_hub  # noqa: F401
    except ImportError as err:
        print(f"bench/export.py needs huggingface_hub (requirements-dev.txt): {err}", file=sys.stderr)
        return 2
    from bench.ranks import run_session

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="export-bench-", dir=out_dir))
    try:
        ckpt = str(scratch / "ckpt")
        started = time.time()
        run_session(_save_rank, 2, ckpt, args.size_mib, timeout=1200)
        shapes = _shapes(args.size_mib)
        largest = max(r * c for r, c in shapes.values()) * 4
        samples: dict[str, list[dict[str, Any]]] = {c: [] for c in CONTENDERS}
        for rep in range(args.reps):
            order = list(CONTENDERS)[rep % len(CONTENDERS) :] + list(CONTENDERS)[: rep % len(CONTENDERS)]
            for contender in reversed(order) if rep % 2 else order:
                target = str(scratch / f"out-{rep}")
                sample = _child(contender, ckpt, target, args.max_shard_size, cold=not args.warm)
                samples[contender].append(sample)
                shutil.rmtree(target)
                peak = sample["peak_extra_bytes"] / 2**20
                print(f"rep {rep} {contender}: {sample['seconds']:.2f}s, peak +{peak:.0f} MiB", flush=True)
        lines = _report(args, samples, largest, time.time() - started)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    (out_dir / "export.md").write_text("\n".join(lines) + "\n")
    doc = {"size_mib": args.size_mib, "max_shard_size": args.max_shard_size, "largest_tensor_bytes": largest}
    (out_dir / "export.json").write_text(json.dumps({**doc, "samples": samples}, indent=1))
    print("\n".join(lines))
    return 0


def _report(args: argparse.Namespace, samples: dict[str, list[dict[str, Any]]], largest: int, took: float) -> list[str]:
    import torch

    mib = 2**20
    base = statistics.median(s["seconds"] for s in samples["shardsafe.export_hf"])
    cold = all(s["cold"] for ss in samples.values() for s in ss)
    lines = [
        f"# Export to the Hugging Face layout: {args.size_mib} MiB checkpoint (2 FSDP2 ranks), "
        f"--max-shard-size {args.max_shard_size}, median of {args.reps}",
        "",
        f"{os.cpu_count()} cores, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M %z')}, load average "
        f"{os.getloadavg()[0]:.2f} at the end; reads {'cold (page cache dropped)' if cold else 'warm'}; "
        f"run took {took:.0f} s. Largest tensor: {largest / mib:.0f} MiB.",
        "",
        "| row | what | median s | shardsafe / this | peak extra MiB (max) | files | largest file MiB "
        "| peak / (largest tensor + largest file) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for contender, what in CONTENDERS.items():
        ss = samples[contender]
        seconds = statistics.median(s["seconds"] for s in ss)
        peak = max(s["peak_extra_bytes"] for s in ss)
        biggest = max((max(s["files"].values(), default=0) for s in ss), default=0)
        ratio = peak / (largest + biggest) if biggest else float("nan")
        lines.append(
            f"| {contender} | {what} | {seconds:.2f} | {base / seconds:.2f}x | {peak / mib:.0f} | "
            f"{len(ss[0]['files'])} | {biggest / mib:.0f} | {ratio:.2f} |"
        )
    ours = samples["shardsafe.export_hf"]
    peak = max(s["peak_extra_bytes"] for s in ours)
    bound = largest + max(max(s["files"].values()) for s in ours)
    verdict = "met" if peak < 1.3 * bound else "NOT met"
    lines += ["", f"Target: export peak < 1.3 x (largest tensor + one shard): {peak / bound:.2f}x, **{verdict}**."]
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
