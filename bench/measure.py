"""How one operation is timed on every rank of a session, and what is recorded about it.

Every measurement starts together on all ranks (a barrier), is timed per rank with a monotonic clock,
and ends with a barrier, so that operations never overlap. A row's time is the slowest rank's (the
operation is done only when every rank is done). Peak memory is the rank's resident-set high-water mark
during the operation above its resident set just before it: the kernel's VmHWM, reset before each
operation through /proc/self/clear_refs, so no short peak is missed between samples.
"""

from __future__ import annotations

import gc
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")


@dataclass
class Sample:
    """One rank's record of one operation in one repetition."""

    kind: str
    world: int
    contender: str
    op: str
    rep: int
    rank: int
    seconds: float
    peak_extra_bytes: int
    io_write_bytes: int
    files_bytes: int | None  # bytes of the files the operation left (rank 0 only; for write amplification)
    cold: bool


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line; the benchmark needs Linux procfs")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current VmRSS (Linux >= 4.0)


def _io_write_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    return 0


def tree_bytes(path: str) -> int:
    """Sum of the sizes of every file under ``path`` (a file or a directory); 0 if it does not exist."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, name)) for name in files)
    return total


def drop_page_cache() -> bool:
    """Write back dirty pages and drop the page cache (needs root); False if the kernel refused."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
    except OSError:
        return False
    return True


class Ctx:
    """(every rank of a session) Runs and records the measurements of one session.

    ``rank``/``world`` are this rank's place; ``root`` is the session's scratch directory on the disk under
    test, the same path on every rank. ``cold`` says whether loads start with a dropped page cache.
    """

    def __init__(self, *, kind: str, rank: int, world: int, root: str, cold: bool) -> None:
        self.kind, self.rank, self.world, self.root, self.cold = kind, rank, world, root, cold
        self.contender = ""
        self.rep = 0
        self.samples: list[dict[str, Any]] = []

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def path(self, name: str) -> str:
        """A fresh path (not created) for a contender's checkpoint, the same on every rank."""
        return os.path.join(self.root, f"{self.contender}-{name}-rep{self.rep}")

    def remove(self, *paths: str) -> None:
        """(every rank) Delete checkpoints once every rank is done with them; untimed."""
        self.barrier()
        if self.rank == 0:
            for path in paths:
                if os.path.isdir(path):
                    shutil.rmtree(path)
                elif os.path.exists(path):
                    os.remove(path)
        self.barrier()

    def _start(self, cold: bool) -> tuple[int, int]:
        if cold and self.rank == 0 and not drop_page_cache():
            raise RuntimeError("could not drop the page cache; run with --warm, or as root outside a container")
        gc.collect()
        self.barrier()
        rss = _status_kib("VmRSS")
        _reset_peak()
        return rss, _io_write_bytes()

    def _record(self, op: str, seconds: float, start: tuple[int, int], files: str | None, cold: bool) -> None:
        peak = (_status_kib("VmHWM") - start[0]) * 1024
        files_bytes = tree_bytes(files) if files is not None and self.rank == 0 else None
        sample = Sample(
            self.kind,
            self.world,
            self.contender,
            op,
            self.rep,
            self.rank,
            seconds,
            max(0, peak),
            _io_write_bytes() - start[1],
            files_bytes,
            cold,
        )
        self.samples.append(asdict(sample))

    def measure(self, op: str, fn: Callable[[], T], *, load: bool = False, files: str | None = None) -> T:
        """(every rank) Time ``fn`` from a common start; a load starts cold when the session is cold.

        ``files``: the path the operation wrote, whose size rank 0 records after it.
        """
        cold = load and self.cold
        start = self._start(cold)
        t0 = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - t0
        self.barrier()
        self._record(op, seconds, start, files, cold)
        return out

    def measure_async(self, op: str, begin: Callable[[], T], wait: Callable[[T], object], *, files: str) -> None:
        """(every rank) Time an asynchronous save: ``<op>.block`` until ``begin`` returns, and
        ``<op>.total`` until ``wait`` returns. The peak covers both."""
        start = self._start(False)
        t0 = time.perf_counter()
        handle = begin()
        blocked = time.perf_counter() - t0
        wait(handle)
        total = time.perf_counter() - t0
        self.barrier()
        self._record(f"{op}.block", blocked, start, None, False)
        self._record(f"{op}.total", total, start, files, False)
