"""The child side of bench/gpu.py: one contender's operations on one state size, in a fresh process,
printed as one ``RESULT {json}`` line. See bench/gpu.py for what is measured and how."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

GIB, MIB = 1 << 30, 1 << 20
# (size of a tensor, how many) in each 100 MiB group of the state: large matrices down to biases
_GROUP = [(64 * MIB, 1), (16 * MIB, 2), (MIB, 4), (16 * 1024, 8)]


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


@contextmanager
def _memory(record: dict[str, Any]) -> Iterator[None]:
    """Peak extra RSS and peak pinned host bytes of the enclosed operation, into ``record``."""
    import torch

    from shardsafe.engine import hostmem

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        record.setdefault("hwm_reset", True)
    except OSError:
        record["hwm_reset"] = False
    rss0 = _status_kib("VmRSS") * 1024
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    stats = getattr(torch.cuda, "host_memory_stats", None) if cuda else None
    if stats is not None:
        torch.cuda.reset_peak_host_memory_stats()
    torch_pinned0 = stats().get("allocated_bytes.current", 0) if stats is not None else 0
    hostmem.reset_peak()
    ours0 = hostmem.pinned_bytes()
    yield
    record["extra_rss"] = max(record.get("extra_rss", 0), _status_kib("VmHWM") * 1024 - rss0)
    torch_pinned = stats().get("allocated_bytes.peak", 0) - torch_pinned0 if stats is not None else 0
    pinned = max(0, torch_pinned) + hostmem.pinned_peak_bytes() - ours0
    record["pinned"] = max(record.get("pinned", 0), pinned)


def _state(nbytes: int, device: str) -> dict[str, Any]:
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    state: dict[str, Any] = {}
    total = 0
    scale = 1 if nbytes >= GIB else 64  # small (smoke) states keep the mix of sizes
    while total < nbytes:
        for size, count in ((size // scale, count) for size, count in _GROUP):
            for _ in range(count):
                n = min(size, nbytes - total) // 4
                if n <= 0:
                    break
                state[f"t{len(state):05d}"] = torch.rand(n, generator=g, device=device)
                total += n * 4
    return state


def _sync() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _evict(path: str) -> str:
    """Drop ``path``'s files from the page cache; say how."""
    files = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs] if os.path.isdir(path) else [path]
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return "drop_caches"
    except OSError:
        return "fadvise"


def _timed(out: dict[str, Any], op: str, fn: Callable[[], Any]) -> Any:
    rec = out.setdefault(op, {"seconds": []})
    with _memory(rec):
        _sync()
        start = time.perf_counter()
        result = fn()
        _sync()
        rec["seconds"].append(time.perf_counter() - start)
    return result


def _fresh(path: str) -> str:
    shutil.rmtree(path, ignore_errors=True)
    if os.path.isfile(path):
        os.unlink(path)
    return path


def _pieces(t: Any) -> Iterator[memoryview]:
    import torch

    mv = memoryview(t.view(torch.uint8).numpy()).cast("B")
    for a in range(0, len(mv), 16 * MIB):
        yield mv[a : a + 16 * MIB]


def _child_floor(state: dict[str, Any], scratch: str, reps: int, out: dict[str, Any]) -> None:
    import torch

    pin = torch.cuda.is_available()
    host = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for k, t in state.items()}
    for h in host.values():
        h.fill_(0)  # faulted in before any timing
    path = os.path.join(scratch, "floor.bin")

    def d2h() -> None:
        for k, t in state.items():
            host[k].copy_(t, non_blocking=pin)

    def write() -> None:
        fd = os.open(_fresh(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for h in host.values():
                for piece in _pieces(h):
                    os.write(fd, piece)
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def read() -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            pos = 0
            for h in host.values():
                for piece in _pieces(h):
                    pos += os.preadv(fd, [piece], pos)
        finally:
            os.close(fd)

    for _ in range(reps):
        _timed(out, "d2h", d2h)
        _timed(out, "write", write)
        out["evicted_by"] = _evict(path)
        _timed(out, "read", read)
    _fresh(path)


def _check(dest: dict[str, Any], state: dict[str, Any], who: str) -> None:
    import torch

    bad = [k for k in state if not torch.equal(dest[k], state[k])]
    if bad:
        raise SystemExit(f"{who}: load restored wrong bytes in {len(bad)} tensors (first {bad[0]})")


def _child_shardsafe(state: dict[str, Any], scratch: str, reps: int, out: dict[str, Any]) -> None:
    import torch

    import shardsafe
    from shardsafe.engine import staging

    assert shardsafe.async_save  # the API is imported on first use: before the first call is timed
    path = os.path.join(scratch, "shardsafe")
    for rep in range(reps + 1):  # the first call of the process, then the steady state
        handle = _timed(
            out, "async_block_first" if rep == 0 else "async_block", lambda: shardsafe.async_save(_fresh(path), state)
        )
        _timed(out, "async_wait", handle.wait)
        total = (
            out["async_block_first" if rep == 0 else "async_block"]["seconds"][-1] + out["async_wait"]["seconds"][-1]
        )
        out.setdefault("async_total_first" if rep == 0 else "async_total", {"seconds": []})["seconds"].append(total)
    out["staged_bytes"] = staging.staged_bytes()
    staging.free_idle()
    for rep in range(reps + 1):  # staging="background" (issue 25): the call returns before the copies
        _sync()
        start = time.perf_counter()
        handle = shardsafe.async_save(_fresh(path), state, staging="background")
        blocked = time.perf_counter() - start  # no device sync here: the copies are meant to run after the call
        out.setdefault("async_block_bg_first" if rep == 0 else "async_block_bg", {"seconds": []})["seconds"].append(
            blocked
        )
        handle.wait()
    staging.free_idle()
    if torch.cuda.is_available():
        _steps(scratch, out)
        staging.free_idle()
    for _ in range(reps):
        _timed(out, "save", lambda: shardsafe.save(_fresh(path), state))
    staging.free_idle()
    dest = {k: torch.zeros_like(t) for k, t in state.items()}
    for _ in range(reps):
        for t in dest.values():
            t.zero_()
        out["evicted_by"] = _evict(path)
        _timed(out, "load", lambda: shardsafe.load(path, dest))
        _check(dest, state, "shardsafe")
    _fresh(path)


def _steps(scratch: str, out: dict[str, Any], quiet_steps: int = 10) -> None:
    """(CUDA only) Step time of a training loop (16 square 4096 layers, AdamW, about 3 GiB of state)
    without a save and with one in flight, per staging mode: the median of the steps that run until
    the save is done, and the first step after the call (it waits for its tensors in background mode)."""
    import torch
    from torch import nn

    import shardsafe

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(16)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    x = torch.randn(2048, 4096, device="cuda")

    def step() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        model(x).float().pow(2).mean().backward()
        opt.step()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    for _ in range(3):
        step()
    out["step_quiet"] = {"seconds": [step() for _ in range(quiet_steps)]}
    path = os.path.join(scratch, "steps")
    for mode in ("background", "blocking"):
        firsts, inflight, calls = [], [], []
        for _ in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            handle = shardsafe.async_save(_fresh(path), {"model": model, "optimizer": opt}, staging=mode)
            calls.append(time.perf_counter() - start)
            times = [step()]
            while not handle.done() and len(times) < 500:
                times.append(step())
            handle.wait()
            firsts.append(times[0])
            inflight += times
        out[f"step_first_{mode}"] = {"seconds": firsts}
        out[f"step_inflight_{mode}"] = {"seconds": inflight}
        out[f"step_call_{mode}"] = {"seconds": calls}
    _fresh(path)


def _child_dcp(state: dict[str, Any], scratch: str, reps: int, out: dict[str, Any]) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    path = os.path.join(scratch, "dcp")
    for rep in range(reps + 1):
        fut = _timed(
            out,
            "async_block_first" if rep == 0 else "async_block",
            lambda: dcp.async_save(state, checkpoint_id=_fresh(path)),
        )
        _timed(out, "async_wait", fut.result)
        total = (
            out["async_block_first" if rep == 0 else "async_block"]["seconds"][-1] + out["async_wait"]["seconds"][-1]
        )
        out.setdefault("async_total_first" if rep == 0 else "async_total", {"seconds": []})["seconds"].append(total)
    for _ in range(reps):
        _timed(out, "save", lambda: dcp.save(state, checkpoint_id=_fresh(path)))
    dest = {k: torch.zeros_like(t) for k, t in state.items()}
    for _ in range(reps):
        for t in dest.values():
            t.zero_()
        out["evicted_by"] = _evict(path)
        _timed(out, "load", lambda: dcp.load(dest, checkpoint_id=path))
        _check(dest, state, "dcp")
    _fresh(path)


def _child_torch(state: dict[str, Any], scratch: str, reps: int, out: dict[str, Any]) -> None:
    import torch

    path = os.path.join(scratch, "torch.pt")

    def save() -> None:
        with open(_fresh(path), "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    dest = {k: torch.zeros_like(t) for k, t in state.items()}

    def load() -> None:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
        for k, t in dest.items():
            t.copy_(loaded[k])

    for _ in range(reps):
        _timed(out, "save", save)
    for _ in range(reps):
        for t in dest.values():
            t.zero_()
        out["evicted_by"] = _evict(path)
        _timed(out, "load", load)
        _check(dest, state, "torch")
    _fresh(path)


def child(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    device = "cuda:0" if not args.smoke else "cpu"
    if device.startswith("cuda"):
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # DCP wants a group
    state = _state(args.size_bytes, device)
    _sync()
    out: dict[str, Any] = {"tensors": len(state), "bytes": sum(t.numel() * 4 for t in state.values())}
    os.makedirs(args.scratch, exist_ok=True)
    {"floor": _child_floor, "shardsafe": _child_shardsafe, "dcp": _child_dcp, "torch": _child_torch}[args.child](
        state, args.scratch, args.reps, out
    )
    dist.destroy_process_group()
    print("RESULT " + json.dumps(out), flush=True)
