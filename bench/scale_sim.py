"""Metadata and coordination at scale, by simulation: N simulated ranks run shardsafe's real save
planning, write reports, commit step, commit protocol and load planning on synthetic layouts of
Llama-style models with AdamW (bench/scale_layouts.py: 7B, 70B, 405B under FSDP2, HSDP and FSDP x
TP) at 256, 1,024 and 4,096 ranks, beside DCP's planner on the same layouts (bench/scale_dcp.py).

    .venv/bin/python bench/scale_sim.py                                   # every cell (hours on 2 cores)
    .venv/bin/python bench/scale_sim.py --models 70B --strategies fsdp2 --worlds 256,1024,4096
    .venv/bin/python bench/scale_sim.py --report                          # tables and chart from the JSON

Per cell (model, strategy, world):

- save (bench/scale_save.py): every rank's ``plan_save``, data file (real header and index around a
  sparse hole) and write report; rank 0's commit step in a fresh process (read the round's messages,
  build, serialise and validate the manifest; publish); with ``--protocol`` up to some world, the
  real commit protocol with a thread per rank on one ``TCPStore`` (store requests per rank);
- load (bench/scale_rank.py, a fresh process per rank, a fake process group, real DTensors over
  untouched memory): shardsafe's ``plan_load`` and DCP's load planning for ranks 0, N/2+1 and N-1;
- DCP: every rank's local save plan, the coordinator's ``create_global_plan`` and the ``.metadata``
  it writes (pickled), in a fresh process. Where DCP's metadata would not fit this machine's memory
  (``--dcp-max-items``), its figures are extrapolated in the number of chunks (tensors x ranks) from
  the largest worlds measured for the same model and strategy (bench/scale_report.py), and marked so.

Writes bench/results/scale.json, scale.md and scale.png (``--out``); keeps nothing else (the scratch
checkpoints are removed after each cell).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "src"))

PY = sys.executable
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), str(HERE.parent)]),
    "OMP_NUM_THREADS": "1",
}


def _child(code: str, args: dict[str, Any], timeout: float = 3600) -> dict[str, Any]:
    """Run ``code`` (Python defining ``main(args) -> dict``) in a fresh process; its JSON result."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(args, f)
    script = f"import json, sys\n{code}\nprint(json.dumps(main(json.load(open(sys.argv[1])))))"
    run = subprocess.run([PY, "-c", script, f.name], capture_output=True, text=True, env=ENV, timeout=timeout)
    os.unlink(f.name)
    if run.returncode != 0:
        raise RuntimeError(f"child failed: {run.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return out


COMMIT = """
from pathlib import Path
from bench.scale_save import commit_step
def main(a):
    return commit_step(
        a["model"], a["strategy"], a["world"], Path(a["messages"]).read_text(), a["target"], a["pending"], a["sid"],
        a["publish"],
    )
"""

PROTOCOL = """
import os
from pathlib import Path
os.environ.setdefault("SHARDSAFE_HEARTBEAT_SECONDS", "5")  # thousands of ranks' watchdogs on 2 cores
os.environ.setdefault("SHARDSAFE_POLL_SECONDS", "2")
os.environ.setdefault("SHARDSAFE_DEAD_AFTER", "300")
from bench.scale_save import protocol
def main(a):
    texts = Path(a["messages"]).read_text().splitlines()
    return protocol(a["model"], a["strategy"], a["world"], texts, a["target"], a["pending"], a["sid"])
"""

DCP = """
import gc, time
from pathlib import Path
from bench.scale_rank import rss
from bench.scale_layouts import Layout, MODELS
from bench.scale_dcp import local_plan, global_plan
def main(a):
    layout = Layout(MODELS[a["model"]], a["strategy"], a["world"])
    started = time.perf_counter()
    plans = [local_plan(layout, r) for r in range(a["world"])]
    local = time.perf_counter() - started
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before, _ = rss()
    out = global_plan(plans, layout)
    growth = rss()[1] - before
    Path(a["out"]).write_bytes(out.pop("raw"))
    return {**out, "rss_growth": growth, "metadata_bytes": Path(a["out"]).stat().st_size, "local_plans_seconds": local}
"""


def run_cell(model: str, strategy: str, world: int, scratch: Path, args: argparse.Namespace) -> dict[str, Any]:
    from bench.scale_layouts import MODELS, Layout
    from bench.scale_save import save_ranks
    from shardsafe.storage.local import LocalStorage

    layout = Layout(MODELS[model], strategy, world)
    cell: dict[str, Any] = {"model": model, "strategy": strategy, "world": world, "tensors": layout.tensors}
    root = scratch / f"{model}-{strategy}-{world}"
    root.mkdir(parents=True)
    target = str(root / "ckpt")
    sid = f"{int(time.time())}{os.urandom(5).hex()}"
    storage = LocalStorage()
    pending = storage.pending_dir(target, sid)
    storage.prepare_pending(pending)
    print(f"[{model} {strategy} {world}] save planning of every rank ...", flush=True)
    saved = save_ranks(model, strategy, world, Path(pending), sid, workers=args.workers)
    messages = root / "messages.txt"
    messages.write_text("".join(t + "\n" for t in saved.pop("texts")))
    cell["save"] = saved
    common = {
        "model": model,
        "strategy": strategy,
        "world": world,
        "messages": str(messages),
        "target": target,
        "pending": pending,
        "sid": sid,
    }
    protocol = world <= args.protocol
    print(f"[{model} {strategy} {world}] rank 0's commit step ...", flush=True)
    cell["commit"] = _child(COMMIT, {**common, "publish": not protocol})
    if protocol:  # publishes the checkpoint the commit step above measured
        print(f"[{model} {strategy} {world}] commit protocol, a thread per rank ...", flush=True)
        cell["protocol"] = _child(PROTOCOL, common)
    files = [p for p in Path(target).iterdir() if p.name.startswith("data-")]
    cell["all_headers_bytes"] = sum(_header_and_index(p) for p in files)
    items = layout.tensors * world
    dcp_meta = root / ".metadata"
    if items <= args.dcp_max_items:
        print(f"[{model} {strategy} {world}] DCP's global plan ...", flush=True)
        cell["dcp"] = _child(DCP, {"model": model, "strategy": strategy, "world": world, "out": str(dcp_meta)})
    ranks = sorted({0, world // 2 + 1, world - 1})
    cell["load"] = {}
    for rank in ranks:
        print(f"[{model} {strategy} {world}] load planning of rank {rank} ...", flush=True)
        spec = {"model": model, "strategy": strategy, "world": world, "rank": rank, "path": target}
        spec["dcp_metadata"] = str(dcp_meta) if dcp_meta.exists() else ""
        spec["dcp_reps"] = 3 if world < 1024 else 1
        spec_file = root / f"load-{rank}.json"
        spec_file.write_text(json.dumps(spec))
        run = subprocess.run(
            [PY, str(HERE / "scale_rank.py"), "load", str(spec_file)],
            capture_output=True,
            text=True,
            env=ENV,
            timeout=7200,
        )
        if run.returncode != 0:
            raise RuntimeError(f"rank {rank}: {run.stderr[-3000:]}")
        cell["load"][str(rank)] = json.loads(run.stdout.strip().splitlines()[-1])
    shutil.rmtree(root)
    return cell


def _header_and_index(path: Path) -> int:
    import struct

    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    index = header.get("/index")  # a file of explicit chunks only (no ruled tensor) has none
    return 8 + n + (int(index["shape"][0]) if index is not None else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="7B,70B,405B")
    parser.add_argument("--strategies", default="fsdp2,hsdp,fsdp_tp")
    parser.add_argument("--worlds", default="256,1024,4096")
    parser.add_argument("--protocol", type=int, default=4096, help="run the threaded commit protocol up to this world")
    parser.add_argument("--dcp-max-items", type=int, default=3_500_000, help="largest DCP plan (tensors x ranks) built")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--scratch", default=str(HERE / "results" / "scale-scratch"))
    parser.add_argument("--report", action="store_true", help="only write scale.md and scale.png from scale.json")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "scale.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {"cells": []}
    if not args.report:
        scratch = Path(args.scratch)
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        for model in args.models.split(","):
            for strategy in args.strategies.split(","):
                for world in map(int, args.worlds.split(",")):
                    started = time.monotonic()
                    cell = run_cell(model, strategy, world, scratch, args)
                    cell["cell_seconds"] = time.monotonic() - started
                    results["cells"] = [
                        c
                        for c in results["cells"]
                        if (c["model"], c["strategy"], c["world"]) != (model, strategy, world)
                    ] + [cell]
                    results["machine"] = _machine()
                    results_path.write_text(json.dumps(results, indent=1))
        shutil.rmtree(scratch, ignore_errors=True)
    real = out / "scale_real.json"
    if real.exists():
        results["real"] = json.loads(real.read_text())
    from bench.scale_report import chart, markdown

    (out / "scale.md").write_text(markdown(results))
    chart(results, str(out / "scale.png"))


def _machine() -> dict[str, Any]:
    import torch

    return {
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


if __name__ == "__main__":
    main()
