"""How much memory this process may still allocate: the bound a reader checks a checkpoint's
declared sizes against before allocating them (docs/format.md, section 8)."""

from __future__ import annotations

import os
import resource


def _meminfo() -> int | None:
    """MemAvailable + SwapFree from ``/proc/meminfo`` (Linux), else free physical pages."""
    try:
        with open("/proc/meminfo", "rb") as f:
            fields = {line.split(b":")[0]: int(line.split()[1]) * 1024 for line in f if line.count(b":") == 1}
        return fields[b"MemAvailable"] + fields.get(b"SwapFree", 0)
    except (OSError, KeyError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def _cgroup() -> int | None:
    """What the cgroup (v2) memory limit leaves, when there is one."""
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open("/sys/fs/cgroup/memory.current") as f:
            return max(0, int(limit) - int(f.read().strip()))
    except (OSError, ValueError):
        return None


def _rlimits() -> int | None:
    """What ``RLIMIT_AS``/``RLIMIT_DATA`` leave beyond this process's current size."""
    try:
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        used = 0
    left = []
    for which in (resource.RLIMIT_AS, resource.RLIMIT_DATA):
        soft, _ = resource.getrlimit(which)
        if soft != resource.RLIM_INFINITY:
            left.append(max(0, soft - used))
    return min(left) if left else None


def available_memory() -> int:
    """Bytes this process can still allocate, as far as the OS tells (the smallest of the free memory
    and swap, the cgroup's limit and the resource limits); a very large number when it tells nothing."""
    known = [n for n in (_meminfo(), _cgroup(), _rlimits()) if n is not None]
    return min(known) if known else 2**62
