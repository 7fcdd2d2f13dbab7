"""Group resolution: which store, ranks and key namespace an operation uses (the default process group,
a given group, or one process), and the user's call site named in desync errors."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch.distributed as dist
from torch._C._distributed_c10d import Store

from shardsafe.errors import InvalidArgumentError

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def call_site() -> str:
    """``file:line`` of the innermost frame outside shardsafe and Lightning Fabric (whose ``fabric.save``
    calls shardsafe.fabric's strategy): the user's call."""
    fabric = [getattr(sys.modules.get(m), "__file__", None) for m in ("lightning.fabric", "lightning_fabric")]
    skipped = (_PACKAGE_DIR, *(os.path.dirname(f) for f in fabric if isinstance(f, str)))  # imported, never here
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(skipped):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


class _Solo:
    """The type of :data:`SOLO`."""

    def __repr__(self) -> str:
        return "shardsafe.coord.resolve.SOLO"


SOLO: Any = _Solo()
"""``group=SOLO``: this process alone, even inside a distributed job (a rank's own share in a node-local
tier, manager/tiers.py): no store, rank 0 of 1. Only for states whose tensors this process holds whole."""


def resolve_group(group: Any) -> tuple[Store | None, int, int, int, str, int]:
    """(store, rank in group, group size, global rank, namespace, identity) of ``group`` or the default
    group. The identity (the default process group object) keys the per-process sequence counter: it
    is stable while the group lives and new when the group is re-created over a fresh store."""
    if group is SOLO:
        return None, 0, 1, 0, "shardsafe/solo", 0
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise InvalidArgumentError("group= was given but torch.distributed is not initialized")
        return None, 0, 1, 0, "shardsafe/local", 0
    pg = group if group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(pg)
    name = "-".join(map(str, ranks)) if len(ranks) <= 8 else f"{len(ranks)}r{hash(tuple(ranks)) & 0xFFFFFFFF:x}"
    store = dist.distributed_c10d._get_default_store()
    identity = id(dist.group.WORLD)
    return store, dist.get_rank(pg), dist.get_world_size(pg), dist.get_rank(), f"shardsafe/g{name}", identity
