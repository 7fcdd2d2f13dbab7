"""Background staging (issue 25): how long ``async_save`` blocks the caller with ``staging="background"``
against ``staging="blocking"`` and DCP's ``async_save``, and what a save in flight costs the training
steps that follow it, in one run, on CPU.

    PYTHONPATH=src .venv/bin/python bench/async_staging.py [--sizes-mib 512 2048] [--reps 3] [--out bench/results]

For each size, the state is a model (a stack of square ``nn.Linear`` layers, fp32) with its AdamW
optimizer after one step: parameters plus two moments make the size (``{"model": m, "optimizer": opt}``
for shardsafe; the same tensors as one flat dict for DCP, which does not take the objects). One
process, no process group. Per size, in order, with ``sync`` before each call:

- ``copy floor``: ``copy_`` of every tensor into host buffers allocated beforehand (what a snapshot of
  the state costs at least: the figure the goal of "0.1x a copy of the state" refers to), timed
  ``--reps`` times back to back beforehand, and once in each rotation right before the background
  call (the same state of the machine: caches cold after the previous save); the faster median of
  the two is the floor;
- the caller's blocking time of ``shardsafe.async_save(..., staging="background")``,
  ``staging="blocking"`` and ``torch.distributed.checkpoint.async_save``, alternating, ``--reps``
  times after a first call per contender (reported apart: it allocates the staging memory); each
  save is waited for (``wait()`` / ``result()``) before the next one starts, outside the timing.

Then the training loop, on the smallest size's model: median step time (forward, backward, AdamW step
on a batch of 32) without a save (``--steps`` of them before each run, all runs' together), and while
a save is in flight (``async_save`` called just before the first of the steps, steps run until the
save is done), for ``background`` and ``blocking`` staging; also the first step after the call (in
background mode it waits in the optimizer's step pre-hook for its tensors to be copied) and the call
plus that first step, which is the training stall a save causes; and the same with the optimizer saved
as ``opt.state_dict()`` (outside the state: the step gate matches it at its first step). Before all
that, the step gate's own cost on a step (``gate_cost``: its hook timed alone, idle and with a save
in flight that does not hold the optimizer's tensors; and matching an optimizer's tensors at its
first step). Results:
``<out>/async_staging.json`` and ``async_staging.md``, as ratios against the peers measured in the
same run. Peak memory stays near 3.5x the largest state (state, gradients freed, the copy floor's
buffers, one staging slab or DCP's copy at a time).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch import nn  # noqa: E402

import shardsafe  # noqa: E402
from shardsafe.engine import staging  # noqa: E402

MIB = 1 << 20
WIDTH = 1024  # layer width: 4 MiB of weights per layer
MODES = ("background", "blocking", "dcp")
OUTSIDE = "background, opt.state_dict()"
TRAINING_MODES = ("background", OUTSIDE, "blocking")


def _model(size_mib: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model whose parameters plus AdamW's two moments hold about ``size_mib`` MiB."""
    layers = max(1, round(size_mib * MIB / 3 / ((WIDTH * WIDTH + WIDTH) * 4)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _step(model, opt)
    opt.zero_grad(set_to_none=True)
    return model, opt


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(32, WIDTH)
    opt.zero_grad(set_to_none=False)
    model(x).pow(2).mean().backward()
    opt.step()


def _tensors(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    flat = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        flat.update({f"optim.{i}.{k}": v for k, v in st.items() if isinstance(v, torch.Tensor)})
    return flat


def _fresh(path: Path) -> str:
    shutil.rmtree(path, ignore_errors=True)
    return str(path)


_FULL_COLLECTIONS: list[float] = []  # when each full collection of Python's garbage collector began


def _on_gc(phase: str, info: dict[str, Any]) -> None:
    if phase == "start" and info.get("generation") == 2:
        _FULL_COLLECTIONS.append(time.perf_counter())


gc.callbacks.append(_on_gc)


_CPU: list[float] = []  # the caller's CPU seconds (thread time) of each background call, in order


def _call(mode: str, model: nn.Module, opt: torch.optim.Optimizer, path: Path) -> tuple[float, Any, int]:
    """One call of ``mode``: the seconds it blocked, what waits for its save, and how many full garbage
    collections began while it blocked. A background call's CPU time on the caller's thread goes to
    ``_CPU``: on a shared machine it is the steadier figure (no time spent descheduled)."""
    os.sync()  # no call pays for the write-back of the one before
    target = _fresh(path)
    before = len(_FULL_COLLECTIONS)
    if mode == "dcp":
        flat = _tensors(model, opt)
        t0 = time.perf_counter()
        fut = dcp.async_save(flat, checkpoint_id=target)
        return time.perf_counter() - t0, fut.result, len(_FULL_COLLECTIONS) - before
    c0 = time.thread_time()
    t0 = time.perf_counter()
    handle = shardsafe.async_save(target, {"model": model, "optimizer": opt}, staging=mode)
    seconds = time.perf_counter() - t0
    if mode == "background":
        _CPU.append(time.thread_time() - c0)
    return seconds, handle.wait, len(_FULL_COLLECTIONS) - before


def _copy(bufs: list[torch.Tensor], tensors: list[torch.Tensor]) -> float:
    """Seconds of a ``copy_`` of every tensor into its buffer (allocated and faulted in beforehand)."""
    t0 = time.perf_counter()
    for b, t in zip(bufs, tensors, strict=True):
        b.copy_(t)
    return time.perf_counter() - t0


def blocking(size_mib: int, reps: int, scratch: Path) -> dict[str, Any]:
    model, opt = _model(size_mib)
    tensors = list(_tensors(model, opt).values())
    nbytes = sum(t.nbytes for t in tensors)
    bufs = [torch.empty_like(t) for t in tensors]
    for b, t in zip(bufs, tensors, strict=True):  # fault the pages in: the floor copies into memory that is there
        b.copy_(t)
    quiet_floor = []
    for _ in range(reps):
        quiet_floor.append(_copy(bufs, tensors))
    floor = []  # the copy once more in each rotation, right before the background call: the same conditions
    first: dict[str, float] = {}
    steady: dict[str, list[float]] = {m: [] for m in MODES}
    _CPU.clear()
    collected: list[int] = []  # per steady background call: full collections that began during it
    for rep in range(reps + 1):
        for mode in MODES:
            if mode == "background":
                os.sync()
                floor.append(_copy(bufs, tensors))
            seconds, wait, collections = _call(mode, model, opt, scratch / mode)
            wait()
            if mode == "background" and rep > 0:
                collected.append(collections)
            if rep == 0:
                first[mode] = seconds
            else:
                steady[mode].append(seconds)
            if mode == "blocking" or rep == reps:  # blocking reuses background's slab (as a run's next save would);
                staging.free_idle()  # DCP runs without it, and the next background call allocates its own
    del bufs, tensors
    for mode in MODES:
        _fresh(scratch / mode)
    med = {m: statistics.median(v) for m, v in steady.items()}
    copy = min(statistics.median(floor[1:]), statistics.median(quiet_floor))  # the faster: the stricter ratio
    return {
        "size_mib": size_mib,
        "bytes": nbytes,
        "tensors": len(list(model.parameters())) * 4,
        "copy_floor_s": copy,
        "copy_rotation_s": statistics.median(floor[1:]),
        "copy_rotation_all_s": floor[1:],
        "copy_quiet_s": statistics.median(quiet_floor),
        "background_full_collections": collected,
        "background_cpu_s": statistics.median(_CPU[1:]),  # the caller's thread time, steady calls
        "first_s": first,
        "blocked_s": med,
        "blocked_all_s": steady,
        "background_over_copy": med["background"] / copy,
        "background_over_blocking": med["background"] / med["blocking"],
        "background_over_dcp": med["background"] / med["dcp"],
        "blocking_over_dcp": med["blocking"] / med["dcp"],
    }


def training(size_mib: int, steps: int, scratch: Path, threads: int) -> dict[str, Any]:
    """Step times without and with a save in flight. The training gets ``threads`` intra-op threads
    (default: all cores but one): OpenMP teams that share their cores with the save's threads wait at
    every barrier for the thread that was descheduled, which measures the scheduler, not the save."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _training(size_mib, steps, scratch, threads)
    finally:
        torch.set_num_threads(previous)


def _training(size_mib: int, steps: int, scratch: Path, threads: int) -> dict[str, Any]:
    model, opt = _model(size_mib)
    for _ in range(2):
        _step(model, opt)
    quiet: list[float] = []

    def quiet_steps(n: int) -> None:
        for _ in range(n):
            t0 = time.perf_counter()
            _step(model, opt)
            quiet.append(time.perf_counter() - t0)

    out: dict[str, Any] = {"size_mib": size_mib, "threads": threads}
    for mode in TRAINING_MODES:
        rows: list[dict[str, Any]] = []
        for _ in range(3):
            target = _fresh(scratch / mode)  # removing the previous save is not the call's
            os.sync()
            quiet_steps(steps)  # the quiet steps are taken beside the runs: the machine's state drifts
            state: dict[str, Any] = {"model": model, "optimizer": opt}
            if mode == OUTSIDE:  # the optimizer outside the state: its first step is matched by storage
                state["optimizer"] = opt.state_dict()
            t0 = time.perf_counter()
            handle = shardsafe.async_save(target, state, staging="blocking" if mode == "blocking" else "background")
            call = time.perf_counter() - t0
            times = []
            while not handle.done() or len(times) < 2:
                s0 = time.perf_counter()
                _step(model, opt)
                times.append(time.perf_counter() - s0)
                if len(times) >= 200:
                    break
            handle.wait()
            rows.append({"call_s": call, "first_step_s": times[0], "steps_in_flight_s": times})
        inflight = [t for r in rows for t in r["steps_in_flight_s"]]
        out[mode] = {
            "call_s": statistics.median(r["call_s"] for r in rows),
            "first_step_s": statistics.median(r["first_step_s"] for r in rows),
            "stall_s": statistics.median(r["call_s"] + r["first_step_s"] for r in rows),
            "step_in_flight_s": statistics.median(inflight),
            "steps_in_flight": len(inflight),
            "runs": rows,
        }
        staging.free_idle()
    for mode in TRAINING_MODES:
        _fresh(scratch / mode)
    out["quiet_step_s"] = quiet_s = statistics.median(quiet)
    out["quiet_steps"] = len(quiet)
    for mode in TRAINING_MODES:
        m = out[mode]
        m["step_in_flight_over_quiet"] = m["step_in_flight_s"] / quiet_s
        m["stall_over_quiet_step"] = m["stall_s"] / quiet_s
        m["extra_stall_s"] = m["stall_s"] - quiet_s  # what the save added to the step it interrupted
    blocking_extra = out["blocking"]["extra_stall_s"]  # within the noise of a step time: no ratio to read
    out["extra_stall_background_over_blocking"] = (
        out["background"]["extra_stall_s"] / blocking_extra if blocking_extra > 0.05 * quiet_s else None
    )
    return out


def gate_cost(model_mib: int, calls: int = 100_000) -> dict[str, Any]:
    """What the step gate (engine/stepgate.py) adds to every ``optimizer.step()``: the gate's hook timed
    alone (it runs before every step of every optimizer), with no save in flight and while a background
    save of other tensors is staging (held: its copies wait; the optimizer, whose tensors the save does
    not hold, was matched at its first step), medians of 5 batches of ``calls``; beside it, the step of
    a one-element SGD it is added to. Then the matching of an optimizer outside the state at its first
    step (its tensors' storages), for the ``model_mib`` model, once per save."""
    from shardsafe.engine import sources, stepgate

    p = nn.Parameter(torch.zeros(1))
    p.grad = torch.zeros(1)
    tiny = torch.optim.SGD([p], lr=0.1)

    def per_call(fn: Any, n: int) -> float:
        batches = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            batches.append((time.perf_counter() - t0) / n)
        return statistics.median(batches)

    out = {"step_s": per_call(tiny.step, calls // 10)}
    out["hook_idle_s"] = per_call(lambda: stepgate._hook(tiny, (), {}), calls)
    held = threading.Event()
    staging.before_background_copy = lambda _name: held.wait(60)
    try:
        with tempfile.TemporaryDirectory() as where:
            handle = shardsafe.async_save(f"{where}/c", {"w": torch.zeros(1 << 16)}, staging="background")
            tiny.step()  # its first step: matched (none of its tensors is the save's)
            out["hook_in_flight_s"] = per_call(lambda: stepgate._hook(tiny, (), {}), calls)
            held.set()
            handle.wait()
    finally:
        held.set()
        staging.before_background_copy = None
    _, opt = _model(model_mib)
    tensors = sum(len(g["params"]) for g in opt.param_groups) + sum(len(v) for v in opt.state.values())
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        sources.optimizer_keys(opt)
        times.append(time.perf_counter() - t0)
    out["match_s"] = statistics.median(times)
    out["match_tensors"] = tensors
    return out


def markdown(report: dict[str, Any]) -> str:
    cfg = report["config"]
    lines = [
        "# Background staging: the caller's blocking time and the training steps",
        "",
        f"CPU only ({cfg['machine']}, {cfg['cores']} cores, torch {cfg['torch']}), one process, fp32 model plus "
        f"AdamW state, medians of {cfg['reps']} calls after a first one. Command: "
        f"`PYTHONPATH=src python bench/async_staging.py --sizes-mib {' '.join(map(str, cfg['sizes_mib']))} "
        f"--reps {cfg['reps']}`.",
        "",
        "Timed on a 2-core machine shared with other jobs: single figures vary by 2-5x between runs; the ratios "
        "of the same run are what to read.",
        "",
        "## Caller blocked by `async_save`",
        "",
        "| state | copy floor | background | blocking | DCP async_save | background / copy | background / "
        "blocking | background / DCP | background: per tensor, slowest call | first call: background, blocking, DCP |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in report["blocking"]:
        b = r["blocked_s"]
        f = r["first_s"]
        lines.append(
            f"| {r['bytes'] / MIB:.0f} MiB | {r['copy_floor_s'] * 1e3:.1f} ms | {b['background'] * 1e3:.1f} ms | "
            f"{b['blocking'] * 1e3:.1f} ms | {b['dcp'] * 1e3:.1f} ms | **{r['background_over_copy']:.3f}** | "
            f"**{r['background_over_blocking']:.3f}** | **{r['background_over_dcp']:.3f}** | "
            f"{b['background'] / r['tensors'] * 1e6:.1f} µs ({r['tensors']} tensors), "
            f"{max(r['blocked_all_s']['background']) * 1e3:.1f} ms | "
            f"{f['background'] * 1e3:.1f} / {f['blocking'] * 1e3:.1f} / {f['dcp'] * 1e3:.1f} ms |"
        )
    lines += [
        "",
        "Copy floor: the faster of two medians (the stricter ratio): the copy timed back to back before the "
        "rotation, and timed in each rotation right before the background call. Here "
        + "; ".join(
            f"{r['bytes'] / MIB:.0f} MiB: {r['copy_quiet_s'] * 1e3:.1f} ms back to back, "
            f"{r['copy_rotation_s'] * 1e3:.1f} ms in the rotation"
            for r in report["blocking"]
        )
        + ". The background call's CPU time on the caller's thread (steadier than its wall time on a shared "
        "machine, where the caller may wait descheduled): "
        + "; ".join(f"{r['bytes'] / MIB:.0f} MiB: {r['background_cpu_s'] * 1e3:.2f} ms" for r in report["blocking"])
        + ". Full collections of Python's garbage collector (a pause of tens of ms with torch loaded) that began "
        "while a background call blocked, per call: "
        + "; ".join(f"{r['bytes'] / MIB:.0f} MiB: {r['background_full_collections']}" for r in report["blocking"])
        + ".",
    ]
    t = report["training"]
    lines += [
        "",
        f"## Training steps with a save in flight ({t['size_mib']} MiB state, {t['threads']} intra-op thread(s) "
        f"for the training, quiet step {t['quiet_step_s'] * 1e3:.0f} ms: median of {t['quiet_steps']} taken "
        "before each run)",
        "",
        "| staging | call | first step after it | call + first step | extra stall | steps in flight: median | "
        "/ quiet step |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in TRAINING_MODES:
        m = t[mode]
        lines.append(
            f"| {mode} | {m['call_s'] * 1e3:.1f} ms | {m['first_step_s'] * 1e3:.0f} ms | {m['stall_s'] * 1e3:.0f} ms | "
            f"{m['extra_stall_s'] * 1e3:.0f} ms | {m['step_in_flight_s'] * 1e3:.0f} ms ({m['steps_in_flight']} "
            f"steps) | **{m['step_in_flight_over_quiet']:.2f}** |"
        )
    lines += [
        "",
        "Extra stall of the interrupted step, background / blocking: "
        + (
            f"**{ratio:.2f}**"
            if (ratio := t["extra_stall_background_over_blocking"]) is not None
            else "not given (the blocking mode's extra stall is within 5% of a quiet step, the noise of this machine)"
        )
        + ". In background mode the first step waits in the "
        "optimizer's step pre-hook until its parameters and moments are copied, so the call plus that step "
        "costs about one copy of the optimizer's tensors (made by every core once a step waits); in blocking "
        "mode the call itself makes the copy. Steps after it run beside the write, which competes with them "
        "for the cores on this machine. With the optimizer saved as `opt.state_dict()` (outside the state), "
        "its first step is matched to the save's tensors by storage, then waits the same way.",
    ]
    g = report["gate"]
    lines += [
        "",
        "## The step gate's cost on a step",
        "",
        f"The gate's hook, which runs before every step of every optimizer once a background save has installed "
        f"it: {g['hook_idle_s'] * 1e9:.0f} ns a step with no save in flight, {g['hook_in_flight_s'] * 1e9:.0f} ns "
        f"while a save that does not hold the optimizer's tensors is staging (a one-element SGD's step takes "
        f"{g['step_s'] * 1e6:.1f} µs here; medians of 5 batches). Matching an optimizer outside the state at its "
        f"first step: {g['match_s'] * 1e3:.2f} ms for its {g['match_tensors']} tensors "
        f"({g['match_s'] / g['match_tensors'] * 1e6:.2f} µs a tensor), once per save.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[512, 2048], help="state sizes (default 512 2048)")
    p.add_argument("--reps", type=int, default=3, help="calls per contender after the first (default 3)")
    p.add_argument("--steps", type=int, default=3, help="quiet training steps timed before each run (default 3)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"), help="output directory")
    p.add_argument(
        "--train-threads",
        type=int,
        default=max(1, (os.cpu_count() or 2) - 1),
        help="intra-op threads of the training loop (default: all cores but one, left to the save)",
    )
    args = p.parse_args(argv)
    out = Path(args.out)
    scratch = out / f"async-staging-{os.getpid()}.tmp"
    scratch.mkdir(parents=True)
    try:
        gate = gate_cost(min(args.sizes_mib))
        rows = [blocking(size, args.reps, scratch) for size in args.sizes_mib]
        train = training(min(args.sizes_mib), args.steps, scratch, args.train_threads)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report = {
        "config": {
            "sizes_mib": args.sizes_mib,
            "reps": args.reps,
            "steps": args.steps,
            "torch": torch.__version__,
            "machine": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "threads": torch.get_num_threads(),
        },
        "blocking": rows,
        "training": train,
        "gate": gate,
    }
    (out / "async_staging.json").write_text(json.dumps(report, indent=1))
    text = markdown(report)
    (out / "async_staging.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
