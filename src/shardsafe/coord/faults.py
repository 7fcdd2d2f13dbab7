"""Fault injection at named points of the save/load protocol, for tests. Free when off: one
environment lookup per point.

``SHARDSAFE_FAULT`` holds one or more comma-separated specs ``POINT:rank=R:ACTION[=ARG]``:

- ``POINT`` a name from :data:`POINTS` (``*`` matches every point);
- ``rank=R`` the global rank that misbehaves (``rank=*`` for all);
- ``ACTION`` is ``raise`` (an ``OSError`` as a failing disk would), ``exit`` (``os._exit(ARG or 13)``,
  no cleanup, like a crash), ``kill`` (SIGKILL to itself), ``stop`` (SIGSTOP to itself: the whole
  process freezes, as a swapping or preempted node does, until someone sends SIGCONT) or
  ``sleep=SECONDS``.

Example: ``SHARDSAFE_FAULT=save.commit:rank=0:exit``.
"""

from __future__ import annotations

import os
import signal
import time

from shardsafe.errors import InvalidArgumentError

POINTS: dict[str, str] = {
    "save.rendezvous": "every rank, after arriving, before planning",
    "save.plan": "every rank, after computing the write plan, before staging or writing",
    "save.stage": "every rank, after copying its share into staging buffers (async save)",
    "save.write": "a writing rank, after its first piece of data reached the file",
    "save.fsync": "a writing rank (local disk), inside the fsync of its data file, under the deadline",
    "save.side_files": "rank 0, after each side file it wrote (files=, write_files=), before the next",
    "save.report": "every rank, after fsync of its files, before reporting to rank 0",
    "save.commit": "rank 0, all reports received, before building the manifest and deciding",
    "save.publish": "rank 0, commit decided, before the manifest becomes visible (under the publish deadline)",
    "save.confirm": "every rank, after reading the committed outcome, before acknowledging it",
    "load.rendezvous": "every rank, after arriving, before reading the manifest",
    "load.read": "every rank, after reading its first chunk",
}


class InjectedFault(OSError):
    """The error an injected ``raise`` produces (an ``OSError``, like a failing disk). It stays here and
    is no :class:`~shardsafe.errors.CheckpointError` on purpose: it stands for a failure of the disk or
    the network, so it must take the path a real ``OSError`` takes (mapped to ``StorageError``, retried,
    wrapped with its phase); a shardsafe error would pass through unmapped."""


def fault_point(point: str, rank: int | None = None) -> None:
    """Misbehave here if ``SHARDSAFE_FAULT`` says so for this point and rank (``None``: this
    process's global rank in the default process group, 0 without one)."""
    spec = os.environ.get("SHARDSAFE_FAULT")
    if not spec:
        return
    if rank is None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    for item in spec.split(","):
        _maybe_fire(item.strip(), point, rank)


def _maybe_fire(item: str, point: str, rank: int) -> None:
    parts = item.split(":")
    if len(parts) != 3 or not parts[1].startswith("rank="):
        raise InvalidArgumentError(f"SHARDSAFE_FAULT item {item!r} is not POINT:rank=R:ACTION")
    name, rank_part, action = parts
    if name != "*" and name not in POINTS:  # before matching: a misspelt point must not pass silently
        raise InvalidArgumentError(f"SHARDSAFE_FAULT names unknown point {name!r}; known: {', '.join(POINTS)}")
    if name not in ("*", point):
        return
    want = rank_part[len("rank=") :]
    if want != "*" and int(want) != rank:
        return
    verb, _, arg = action.partition("=")
    if verb == "raise":
        raise InjectedFault(f"injected fault at {point} on rank {rank}")
    if verb == "exit":
        os._exit(int(arg or 13))
    if verb == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if verb == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    if verb == "sleep":
        time.sleep(float(arg))
        return
    raise InvalidArgumentError(f"SHARDSAFE_FAULT action {action!r} is not raise, exit, kill, stop or sleep=S")
